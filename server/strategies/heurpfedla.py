"""HeurpFedLA (Ma et al.): pFedLA where each client's top-k tensors by self-weight αᵢˡⁱ stay on the device.

Those tensors are neither sent to the device nor uploaded by it, which saves their bytes both ways;
the device is told their names in the round settings (`kept_on_device`) and trains its own copy, the
server's copy goes stale, and their heads get no hypernetwork step that round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field

from edgepfl.errors import UsageError
from edgepfl.manifest import TensorSpec
from edgepfl.options import titled
from edgepfl.protocol import RoundSettings
from edgepfl.server.strategies.pfedla import PFedLA, PFedLAOptions
from edgepfl.server.strategy import RoundPlan


class RetainOptions(BaseModel):
    """HeurpFedLA's tensors kept on the device (heurpfedla)"""

    model_config = titled("HeurpFedLA")

    retain_top_k: Annotated[
        int, Field(ge=1, description="heurpfedla: tensors (largest self-weight) a device keeps instead of exchanging")
    ] = 1


class HeurPFedLAOptions(PFedLAOptions, RetainOptions):
    """heurpfedla's own options: pfedla's and the tensors kept on the device."""


class HeurPFedLA(PFedLA):
    """pFedLA whose per-device payload leaves out the k tensors the client weighs most on itself."""

    name = "heurpfedla"
    Options = HeurPFedLAOptions

    def __init__(self, specs: list[TensorSpec], options: HeurPFedLAOptions, settings: RoundSettings, seed: int = 0):
        super().__init__(specs, options, settings, seed)
        if not 1 <= options.retain_top_k <= len(self.mixed):
            raise UsageError(
                f"heurpfedla keeps the top-k tensors on the device, and k={options.retain_top_k} is not in "
                f"1..{len(self.mixed)}",
                "pass e.g. --retain-top-k 1",
            )

    def retained(self, device: str) -> list[str]:
        """The k mixed tensors with the largest self-weight αᵢˡⁱ (ties: manifest order); they stay on the device."""
        slot = self.slot_of(device)
        alphas = self.mixing_weights(slot)
        order = sorted(range(len(self.mixed)), key=lambda index: (-alphas[self.mixed[index]][slot], index))
        return [self.mixed[index] for index in order[: self.options.retain_top_k]]

    def configure_round(
        self, round_id: int, sampled: Sequence[str], global_base: Mapping[str, np.ndarray]
    ) -> dict[str, RoundPlan]:
        """pFedLA's θ̄ᵢ without each device's retained tensors, and settings that name them."""
        plans = super().configure_round(round_id, sampled, global_base)
        for device, (settings, payload) in plans.items():
            kept = self.retained(device)
            trimmed = {name: value for name, value in payload.items() if name not in kept}
            plans[device] = (settings.model_copy(update={"kept_on_device": tuple(kept)}), trimmed)
        return plans
