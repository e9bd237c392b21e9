"""Coordinate-wise trimmed mean (Yin et al. 2018): drop the extremes per coordinate, average the rest."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated

import numpy as np
from pydantic import BaseModel, Field

from edgepfl.options import OPTIONS
from edgepfl.server.strategies.median import coordinatewise
from edgepfl.server.strategy import AcceptedUpdate, BaseTensors, Strategy


class TrimmedMeanOptions(BaseModel):
    """trimmed-mean's own option."""

    model_config = OPTIONS

    trim_fraction: Annotated[
        float, Field(ge=0.0, lt=0.5, description="trimmed-mean: fraction of the values cut from each end")
    ] = 0.1


class TrimmedMean(Strategy):
    """Per coordinate, sort the devices' values, cut `trim_fraction` from each end, take the plain mean.

    Like the median it works tensor by tensor: O(devices x largest tensor) memory. With n updates,
    k = floor(trim_fraction * n) values are cut from each end, and never so many that nothing is left.
    """

    name = "trimmed-mean"
    Options = TrimmedMeanOptions
    streaming = False

    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """Coordinate-wise trimmed mean over the accepted updates."""

        def trimmed(stack: np.ndarray) -> np.ndarray:
            count = stack.shape[0]
            cut = min(int(np.floor(self.options.trim_fraction * count)), (count - 1) // 2)
            return np.sort(stack.astype(np.float64), axis=0)[cut : count - cut].mean(axis=0)

        return coordinatewise(round_id, updates, self.specs, trimmed)
