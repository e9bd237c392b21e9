"""Coordinate-wise median (Yin et al. 2018): robust to a minority of arbitrary updates."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from edgepfl.server.strategy import AcceptedUpdate, BaseTensors, Strategy, cast_like


class Median(Strategy):
    """Per-coordinate median of the devices' base tensors, unweighted.

    A median needs every value of a coordinate at once, so memory is O(devices x model) (float32 or
    the tensors' own dtype), unlike FedAvg's running sum.
    """

    name = "median"
    streaming = False

    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """Coordinate-wise median over the accepted updates."""
        stacks = stack_updates(round_id, updates, self.specs)
        return cast_like({name: np.median(stack, axis=0) for name, stack in stacks.items()}, self.specs)


def stack_updates(round_id: int, updates: Iterable[AcceptedUpdate], specs: list) -> dict[str, np.ndarray]:
    """Stack each tensor over devices: name -> array of shape (devices, *shape)."""
    columns: dict[str, list[np.ndarray]] = {spec.name: [] for spec in specs}
    for update in updates:
        for name, column in columns.items():
            column.append(np.asarray(update.base_tensors[name]))
    if not any(columns.values()):
        raise ValueError(f"round {round_id} has no updates to aggregate")
    return {name: np.stack(column) for name, column in columns.items()}
