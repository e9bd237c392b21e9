"""`edgepfl device predict`: what the device's own model sees in its inputs (images, windows, a typed phrase),
read and pre-processed by the bundle's kind exactly as its training data."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.data import check_inputs
from edgepfl.device_runtime.engine import Engine, open_engine
from edgepfl.device_runtime.state import read_saved_model
from edgepfl.errors import DataError
from edgepfl.kinds import read_npz
from edgepfl.manifest import Manifest

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


def predict_inputs(paths: Sequence[str | os.PathLike], engine: Engine) -> tuple[list[str], np.ndarray]:
    """The inputs' names and class probabilities (n, classes), read and predicted CHUNK inputs at a time."""
    names: list[str] = []
    probabilities = []
    for chunk_names, x in iter_inputs(paths, engine):
        names += chunk_names
        probabilities.append(engine.predict(x))
    return names, np.concatenate(probabilities)


def iter_inputs(paths: Sequence[str | os.PathLike], engine: Engine) -> Iterator[tuple[list[str], np.ndarray]]:
    """(names, model input) of at most CHUNK inputs at a time; every path is checked before the first chunk."""
    manifest = engine.manifest
    sources = [_source(Path(given), manifest) for given in paths]
    if not sources:
        raise DataError("no inputs to predict", "pass image files, folders of images or .npz files")
    kind = manifest.kind
    for path, content in sources:
        if isinstance(content, np.ndarray):  # an .npz's samples as stored, normalised a chunk at a time
            for start in range(0, len(content), CHUNK):
                rows = range(start, min(start + CHUNK, len(content)))
                yield [f"{path}[{row}]" for row in rows], kind.normalize(content[start : rows.stop])
            continue
        for start in range(0, len(content), CHUNK):
            files = content[start : start + CHUNK]
            yield (
                [str(file) for file in files],
                np.concatenate([kind.normalize(kind.read_input_file(f)) for f in files]),
            )


def top_classes(names: Sequence[str], probabilities: np.ndarray, labels: Sequence[str], k: int) -> list[Prediction]:
    """Each input's `k` most likely classes (ties: the lower class index first)."""
    k = min(k, probabilities.shape[1])
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return [
        Prediction(name, tuple((int(c), labels[c], float(row[c])) for c in classes))
        for name, row, classes in zip(names, probabilities, order)
    ]


def _source(path: Path, manifest: Manifest) -> tuple[Path, list[Path] | np.ndarray]:
    """What one input path holds: an .npz's samples checked against the model as training data is
    (edgepfl.data.check_inputs), or the files the bundle's kind reads an input each from (images)."""
    if path.is_file() and path.suffix.lower() == ".npz":
        (x,) = read_npz(path, keys=("x",))
        samples = check_inputs(np.asarray(x), manifest, what=f"{path} x")
        if not len(samples):
            raise DataError(
                f"{path} x holds no samples", f"save at least one of the model's {manifest.kind.described} as x"
            )
        return path, samples
    return path, manifest.kind.input_files(path)


def next_words(engine: Engine, phrase: str, k: int, state: Path | None = None) -> tuple[tuple[int, str, float], ...]:
    """The `k` words a keyboard offers after `phrase` as (id, word, probability), most likely first: the model's (no
    special token, ties: lower id) and the person's own words the `state` folder keeps, at <oov>'s probability
    (edgepfl/kinds/userwords.py). UsageError for a bundle of another kind."""
    manifest = engine.manifest
    context = manifest.kind.phrase_input(phrase, engine.bundle_dir, manifest.num_classes)
    probabilities = engine.predict(context)[0]
    return tuple(manifest.kind.offered(probabilities, engine.bundle_dir, state, k))
