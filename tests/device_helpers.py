"""What the device tests ask of a device's model beyond what `device predict` does: whole arrays at once."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.predict import CHUNK, iter_inputs


def predict_all(engine: Engine, x: np.ndarray) -> np.ndarray:
    """Class probabilities (n, classes) of the engine's model on model input `x`, CHUNK rows a call."""
    return np.concatenate([engine.predict(x[start : start + CHUNK]) for start in range(0, len(x), CHUNK)])


def read_inputs(paths: Sequence[str | os.PathLike], engine: Engine) -> tuple[list[str], np.ndarray]:
    """The inputs' names and their model input, read and normalised as `device predict` reads them."""
    chunks = list(iter_inputs(paths, engine))
    return [name for names, _ in chunks for name in names], np.concatenate([x for _, x in chunks])
