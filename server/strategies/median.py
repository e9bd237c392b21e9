"""Coordinate-wise median (Yin et al. 2018): robust to a minority of arbitrary updates."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from edgepfl.manifest import TensorSpec
from edgepfl.server.strategy import AcceptedUpdate, BaseTensors, Strategy, cast_like


class Median(Strategy):
    """Per-coordinate median of the devices' base tensors, unweighted.

    A median needs every device's value of a coordinate at once; tensor by tensor (the uploads are read
    from disk one tensor at a time), that is O(devices x largest tensor) memory, not O(devices x model).
    """

    name = "median"
    streaming = False

    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """Coordinate-wise median over the accepted updates."""
        return coordinatewise(round_id, updates, self.specs, lambda stack: np.median(stack, axis=0))


def coordinatewise(
    round_id: int,
    updates: Iterable[AcceptedUpdate],
    specs: list[TensorSpec],
    reduce: Callable[[np.ndarray], np.ndarray],
) -> BaseTensors:
    """`reduce` over each tensor stacked across devices (devices, *shape), one tensor at a time."""
    updates = list(updates)
    if not updates:
        raise ValueError(f"round {round_id} has no updates to aggregate")
    result = {}
    for spec in specs:
        result[spec.name] = reduce(np.stack([np.asarray(update.base_tensors[spec.name]) for update in updates]))
    return cast_like(result, specs)
