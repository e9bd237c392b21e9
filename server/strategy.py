"""The strategy interface: small classes with a few hooks over one round engine (as in Flower).

The engine owns sampling, deadlines, persistence and HTTP; a strategy decides only what a sampled
device is told to do and how accepted updates become the next global base. A new strategy is one
file in `strategies/` plus one line in the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pydantic import BaseModel

from edgepfl.capabilities import StrategyNeeds, needs_of
from edgepfl.errors import StateError, UsageError
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.options import OPTIONS
from edgepfl.protocol import RoundSettings

if TYPE_CHECKING:
    from edgepfl.secagg.quantize import SecureSum

BaseTensors = dict[str, np.ndarray]
RoundPlan = tuple[RoundSettings, Mapping[str, np.ndarray]]  # what one sampled device is told and sent


@dataclass(frozen=True)
class AcceptedUpdate:
    """One accepted upload, read back from disk (sha256-checked) when the round is aggregated."""

    device: str
    num_samples: int
    base_tensors: Mapping[str, np.ndarray]  # what the upload stands for (empty for a strategy that reads deltas)
    train_loss: float | None = None
    val_accuracy: float | None = None
    delta: Mapping[str, np.ndarray] | None = None  # the decoded delta, for a strategy that reads deltas


class NoOptions(BaseModel):
    """A strategy without options of its own."""

    model_config = OPTIONS


class Strategy(ABC):
    """What the round engine asks of an aggregation strategy."""

    name: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions  # the strategy's own options (its flags)
    personalized: ClassVar[bool] = True  # devices keep personal blocks (False: the whole model is shared)
    streaming: ClassVar[bool] = True  # aggregate() holds O(model) memory, not O(devices x model)
    bounded: ClassVar[bool] = True  # updates arrive with what one device can move bounded (bounds.py)
    reads_deltas: ClassVar[bool] = False  # updates arrive as decoded deltas (`delta`), not as base tensors
    # what the aggregate needs of a round (every update at once, a per-device plan, plaintext updates, a fixed
    # cohort); DP's, secure aggregation's and fedbuff's refusals follow from it (edgepfl.capabilities)
    needs: ClassVar[StrategyNeeds] = needs_of("")
    cohort_option: ClassVar[str | None] = None  # the option a run's number of clients fills (needs.fixed_cohort)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A strategy's needs are those `edgepfl.capabilities` holds for its name (the core checks read them too)."""
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            cls.needs = needs_of(cls.name)

    def __init__(self, specs: list[TensorSpec], options: BaseModel, settings: RoundSettings, seed: int = 0):
        self.specs = specs  # the tensors that travel: the base (and base BatchNorm stats if shared)
        self.options = options  # an instance of `Options`
        self.round_settings = settings  # what every sampled device is told (a strategy may add to it per device)
        self.seed = seed  # the server's --seed: strategies that draw random numbers start from it

    def check_manifest(self, manifest: Manifest) -> None:
        """Refuse a bundle this strategy cannot run (called once at start)."""
        if not self.personalized and manifest.names("personal"):
            raise UsageError(
                f"strategy {self.name} shares the whole model, but this bundle keeps personal tensors "
                f"({manifest.personal_spec}; kp={manifest.kp})",
                "use --strategy fedper, or export the bundle with --kp 0",
            )

    def settings(self, round_id: int) -> RoundSettings:
        """The settings every sampled device gets in a round."""
        return self.round_settings

    def fresh(self) -> Strategy:
        """A new strategy like this one, with nothing learnt yet."""
        return type(self)(self.specs, self.options, self.round_settings, self.seed)

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

    def closing(self, record: Any) -> dict[str, Any]:
        """What closing a round commits besides the new base and the strategy state: `epsilon` and `meta`
        (DP's budget, see budget.py); nothing by default. Called after aggregate(), before the commit."""
        return {}

    def mean_of_sum(self, round_id: int, total: SecureSum, sensitivity: Callable[[], float]) -> dict[str, np.ndarray]:
        """The mean delta a securely summed round gives (secure aggregation's unmasked sum; `sensitivity`: how far one
        device can move it): the sample-weighted mean (DP's wrapper noises it instead)."""
        return total.weighted_mean()

    @abstractmethod
    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """The next global base from the round's accepted updates, which arrive one at a time."""


class WrappingStrategy(Strategy):
    """A strategy around another (DP-FedAvg, secure aggregation): its own `aggregate`, and the inner strategy's
    name, plans, settings, checks and closing commit."""

    def __init__(self, inner: Strategy):
        super().__init__(inner.specs, inner.options, inner.round_settings, inner.seed)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # an instance's name: the strategy it wraps
        self.personalized = inner.personalized  # type: ignore[misc]
        self.needs = inner.needs  # type: ignore[misc]

    def check_manifest(self, manifest: Manifest) -> None:
        """The inner strategy's check."""
        self.inner.check_manifest(manifest)

    def settings(self, round_id: int) -> RoundSettings:
        """The inner strategy's settings."""
        return self.inner.settings(round_id)

    def configure_round(
        self, round_id: int, sampled: Sequence[str], global_base: Mapping[str, np.ndarray]
    ) -> dict[str, RoundPlan]:
        """The inner strategy's plan."""
        return self.inner.configure_round(round_id, sampled, global_base)

    def closing(self, record: Any) -> dict[str, Any]:
        """The inner strategy's (DP: the epsilon spent)."""
        return self.inner.closing(record)

    def mean_of_sum(self, round_id: int, total: SecureSum, sensitivity: Callable[[], float]) -> dict[str, np.ndarray]:
        """The inner strategy's (DP: the noised mean)."""
        return self.inner.mean_of_sum(round_id, total, sensitivity)


def cast_like(values: Mapping[str, np.ndarray], specs: list[TensorSpec]) -> BaseTensors:
    """Cast float64 aggregates back to each tensor's manifest dtype (integers rounded)."""
    result = {}
    for spec in specs:
        value = values[spec.name]
        if np.dtype(spec.dtype).kind in "iub":
            value = np.rint(value)
        result[spec.name] = np.asarray(value).astype(spec.dtype, order="C")  # ascontiguousarray makes 0-d 1-d
    return result
