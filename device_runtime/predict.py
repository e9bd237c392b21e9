"""`edgepfl device predict`: the classes the device's own model sees in images, pre-processed as its training data."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.data import check_pixels, normalize, to_model_layout
from edgepfl.device_runtime.data import IMAGE_SUFFIXES, read_image, read_npz
from edgepfl.device_runtime.engine import Engine, open_engine
from edgepfl.device_runtime.state import read_saved_model
from edgepfl.errors import DataError

CHUNK = 256  # inputs per engine call: bounds the memory of a large folder


@dataclass
class DeviceModel:
    """The model a device holds: an engine with its state folder's tensors (the bundle's initial ones if none)."""

    engine: Engine
    state: Path
    last_completed_round: int | None
    trained: bool

    @property
    def description(self) -> str:
        """One line on which model this is."""
        if not self.trained:
            return f"untrained: the bundle's initial model ({self.state} holds no trained model yet)"
        if self.last_completed_round is not None:
            return f"trained: the device's model after round {self.last_completed_round} ({self.state})"
        return f"trained locally ({self.state})"


@dataclass(frozen=True)
class Prediction:
    """One input's most likely classes: (class index, class name, probability), most likely first."""

    input: str
    top: tuple[tuple[int, str, float], ...]

    def to_json(self) -> dict[str, Any]:
        """The prediction as `device predict --json` prints it."""
        return {
            "input": self.input,
            "top": [{"class": index, "name": name, "probability": p} for index, name, p in self.top],
        }


def open_device_model(
    bundle: str | os.PathLike, state: str | os.PathLike, engine: str = "auto", threads: int | None = None
) -> DeviceModel:
    """The device's model: its personal part with the current base, as its state folder holds them now.

    The state folder is only read (no lock is taken, nothing changes), so a running `device run` may keep it."""
    device_engine = open_engine(bundle, engine, threads=threads)
    saved_state, tensors = read_saved_model(state, device_engine.manifest)
    if tensors is not None:
        device_engine.set_tensors(tensors)
    last_round = saved_state.last_completed_round if saved_state is not None else None
    return DeviceModel(device_engine, Path(state), last_round, trained=tensors is not None)


def read_inputs(paths: Sequence[str | os.PathLike], engine: Engine) -> tuple[list[str], np.ndarray]:
    """The inputs' names and their model input (float32 NCHW, normalised), pre-processed as training data is.

    Each path is an image file, a folder (its images, hidden entries skipped, in path order) or an .npz whose
    `x` holds images (one input per row; `y` is not needed)."""
    manifest = engine.manifest
    names: list[str] = []
    batches: list[np.ndarray] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if _is_image(p, path))
            if not files:
                raise DataError(f"folder {path} holds no images", f"add {', '.join(IMAGE_SUFFIXES)} files to it")
            names += [str(file) for file in files]
            batches += [_image_input(file, engine) for file in files]
        elif path.is_file() and path.suffix.lower() == ".npz":
            (x,) = read_npz(path, keys=("x",))
            images = to_model_layout(np.asarray(x), manifest.input, what=f"{path} x")
            check_pixels(images, what=f"{path} x")
            names += [f"{path}[{row}]" for row in range(len(images))]
            batches.append(normalize(images, manifest.input))
        elif path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
            names.append(str(path))
            batches.append(_image_input(path, engine))
        elif path.is_file():
            raise DataError(
                f"{path} is neither an image ({', '.join(IMAGE_SUFFIXES)}) nor an .npz",
                "pass image files, folders of images or .npz files with images as x",
            )
        else:
            raise DataError(f"{path} does not exist", "pass image files, folders of images or .npz files")
    if not names:
        raise DataError("no inputs to predict", "pass image files, folders of images or .npz files")
    return names, np.concatenate(batches)


def predict(engine: Engine, x: np.ndarray) -> np.ndarray:
    """Class probabilities (n, classes) of the engine's model on model input `x`, in chunks of CHUNK."""
    return np.concatenate([engine.predict(x[start : start + CHUNK]) for start in range(0, len(x), CHUNK)])


def top_classes(names: Sequence[str], probabilities: np.ndarray, labels: Sequence[str], k: int) -> list[Prediction]:
    """Each input's `k` most likely classes (ties: the lower class index first)."""
    k = min(k, probabilities.shape[1])
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return [
        Prediction(name, tuple((int(c), labels[c], float(row[c])) for c in classes))
        for name, row, classes in zip(names, probabilities, order)
    ]


def _is_image(path: Path, folder: Path) -> bool:
    """An image file inside `folder`, not hidden and not inside a hidden folder."""
    inside = path.relative_to(folder).parts
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file() and not any(p.startswith(".") for p in inside)


def _image_input(path: Path, engine: Engine) -> np.ndarray:
    """One image file as a (1, C, H, W) model input."""
    pixels = read_image(path, engine.manifest)  # (H, W, C)
    return normalize(pixels.transpose(2, 0, 1)[None], engine.manifest.input)
