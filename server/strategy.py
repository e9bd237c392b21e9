"""The strategy interface: small classes with a few hooks over one round engine (as in Flower).

The engine owns sampling, deadlines, persistence and HTTP; a strategy decides only what a sampled
device is told to do and how accepted updates become the next global base. A new strategy is one
file in `strategies/` plus one line in the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from edgepfl.errors import StateError, UsageError
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.protocol import RoundSettings

if TYPE_CHECKING:
    from edgepfl.server.config import StrategyOptions

BaseTensors = dict[str, np.ndarray]
RoundPlan = tuple[RoundSettings, Mapping[str, np.ndarray]]  # what one sampled device is told and sent


@dataclass(frozen=True)
class AcceptedUpdate:
    """One accepted upload, read back from disk (sha256-checked) when the round is aggregated."""

    device: str
    num_samples: int
    base_tensors: Mapping[str, np.ndarray]
    train_loss: float | None = None
    val_accuracy: float | None = None


class Strategy(ABC):
    """What the round engine asks of an aggregation strategy."""

    name: ClassVar[str]
    personalized: ClassVar[bool] = True  # devices keep personal blocks (False: the whole model is shared)
    streaming: ClassVar[bool] = True  # aggregate() holds O(model) memory, not O(devices x model)

    def __init__(self, specs: list[TensorSpec], options: StrategyOptions):
        self.specs = specs  # the tensors that travel: the base (and base BatchNorm stats if shared)
        self.options = options

    def check_manifest(self, manifest: Manifest) -> None:
        """Refuse a bundle this strategy cannot run (called once at start)."""
        if not self.personalized and manifest.kp != 0:
            raise UsageError(
                f"strategy {self.name} shares the whole model, but this bundle keeps kp={manifest.kp} personal blocks",
                "use --strategy fedper, or export the bundle with --kp 0",
            )

    def settings(self, round_id: int) -> RoundSettings:
        """The settings every sampled device gets in a round."""
        return self.options.settings

    def configure_round(
        self, round_id: int, sampled: Sequence[str], global_base: Mapping[str, np.ndarray]
    ) -> dict[str, RoundPlan]:
        """Settings and base tensors for every sampled device, planned in `sampled` order (default: the shared base).

        The one hook through which a round is planned: the engine stores a plan's base once per distinct
        mapping object, so a strategy that hands every device `global_base` itself costs one blob.
        """
        settings = self.settings(round_id)
        return {device: (settings, global_base) for device in sampled}

    def evaluation_base(self, device: str, global_base: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The base `device` is evaluated with after a round; never changes the strategy (default: the global base)."""
        return global_base

    def admissible(self, devices: Sequence[str]) -> list[str]:
        """The devices among the available `devices` that this round may sample (default: all of them)."""
        return list(devices)

    def check_device(self, device: str) -> None:
        """Raise EdgePFLError if `device` can never take part in this strategy's rounds (default: any can)."""
        return None

    def state_bytes(self) -> bytes | None:
        """What the strategy learnt beyond the global base (None: nothing); saved as a round opens and closes."""
        return None

    def load_state(self, payload: bytes) -> None:
        """Restore what state_bytes() returned, after a restart (called before any round is configured)."""
        raise StateError(
            f"the state folder holds saved state for strategy {self.name}, which keeps none",
            "restart with the strategy the state folder was made with, or use a new --state folder",
        )

    @abstractmethod
    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """The next global base from the round's accepted updates, which arrive one at a time."""


def cast_like(values: Mapping[str, np.ndarray], specs: list[TensorSpec]) -> BaseTensors:
    """Cast float64 aggregates back to each tensor's manifest dtype (integers rounded)."""
    result = {}
    for spec in specs:
        value = values[spec.name]
        if np.dtype(spec.dtype).kind in "iub":
            value = np.rint(value)
        result[spec.name] = np.asarray(value).astype(spec.dtype, order="C")  # ascontiguousarray makes 0-d 1-d
    return result
