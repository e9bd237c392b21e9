"""HeurpFedLA (Ma et al.): pFedLA where each client's top-k tensors by self-weight αᵢˡⁱ stay on the device.

Those tensors are neither sent to the device nor uploaded by it, which saves their bytes both ways;
the server's copy of them goes stale, and their heads get no hypernetwork step that round. Devices
cannot yet be told to keep tensors back, so this strategy runs in `edgepfl simulate` only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edgepfl.errors import UsageError
from edgepfl.manifest import TensorSpec
from edgepfl.protocol import RoundSettings
from edgepfl.server.config import StrategyOptions
from edgepfl.server.strategies.pfedla import PFedLA


class HeurPFedLA(PFedLA):
    """pFedLA whose per-device payload leaves out the k tensors the client weighs most on itself."""

    name = "heurpfedla"
    simulator_only = True

    def __init__(self, specs: list[TensorSpec], options: StrategyOptions):
        super().__init__(specs, options)
        if not 1 <= options.retain_top_k <= len(self.mixed):
            raise UsageError(
                f"heurpfedla keeps the top-k tensors on the device, and k={options.retain_top_k} is not in "
                f"1..{len(self.mixed)}",
                "pass e.g. retain_top_k 1",
            )

    def retained(self, device: str) -> list[str]:
        """The k mixed tensors with the largest self-weight αᵢˡⁱ (ties: manifest order); they stay on the device."""
        slot = self.slot_of(device)
        alphas = self.mixing_weights(slot)
        order = sorted(range(len(self.mixed)), key=lambda index: (-alphas[self.mixed[index]][slot], index))
        return [self.mixed[index] for index in order[: self.options.retain_top_k]]

    def configure_device(
        self, round_id: int, device: str, global_base: Mapping[str, np.ndarray]
    ) -> tuple[RoundSettings, Mapping[str, np.ndarray]]:
        """pFedLA's θ̄ᵢ without the retained tensors."""
        settings, payload = super().configure_device(round_id, device, global_base)
        kept = set(self.retained(device))
        return settings, {name: value for name, value in payload.items() if name not in kept}
