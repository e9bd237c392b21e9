"""FedAvg: the sample-weighted mean of the shared tensors, kept as a running float64 sum."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from edgepfl.server.strategy import AcceptedUpdate, BaseTensors, Strategy, cast_like


class FedAvg(Strategy):
    """McMahan et al.: every device trains the whole model; the server averages it by sample count."""

    name = "fedavg"
    personalized = False

    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """Weighted mean by num_samples; memory is one float64 copy of the base, whatever the device count."""
        weighted_sum = {spec.name: np.zeros(spec.shape, dtype=np.float64) for spec in self.specs}
        total = 0
        for update in updates:
            for name, acc in weighted_sum.items():
                acc += update.num_samples * np.asarray(update.base_tensors[name], dtype=np.float64)
            total += update.num_samples
        if total == 0:
            raise ValueError(f"round {round_id} has no updates to aggregate")
        return cast_like({name: acc / total for name, acc in weighted_sum.items()}, self.specs)
