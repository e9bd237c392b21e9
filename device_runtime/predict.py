"""`edgepfl device predict`: the classes the device's own model sees in images, pre-processed as its training data."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl import text
from edgepfl.data import check_inputs, normalize
from edgepfl.device_runtime.data import IMAGE_SUFFIXES, read_image, read_npz
from edgepfl.device_runtime.engine import Engine, open_engine
from edgepfl.device_runtime.state import read_saved_model
from edgepfl.device_runtime.task_data import task_kind
from edgepfl.errors import BundleError, DataError, UsageError
from edgepfl.manifest import Manifest

CHUNK = 256  # inputs per engine call: bounds the memory of a large folder
IMAGE, NEXT_WORD = "image", "next-word"  # task_kind of an image and of a text bundle
NEVER_SUGGESTED = (text.PAD_ID, text.OOV_ID, text.BOS_ID)  # tokens nobody types


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
    chunks = list(iter_inputs(paths, engine))
    return [name for names, _ in chunks for name in names], np.concatenate([x for _, x in chunks])


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
    for path, content in sources:
        if isinstance(content, np.ndarray):  # an .npz's images or windows as stored, normalised a chunk at a time
            for start in range(0, len(content), CHUNK):
                rows = range(start, min(start + CHUNK, len(content)))
                yield [f"{path}[{row}]" for row in rows], normalize(content[start : rows.stop], manifest.input)
            continue
        for start in range(0, len(content), CHUNK):
            files = content[start : start + CHUNK]
            yield [str(file) for file in files], np.concatenate([_image_input(file, engine) for file in files])


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


def _source(path: Path, manifest: Manifest) -> tuple[Path, list[Path] | np.ndarray]:
    """What one input path holds: its image files, or an .npz's samples (images, or a text or sensor bundle's
    windows) checked against the model as training data is (edgepfl.data.check_inputs)."""
    if task_kind(manifest) != IMAGE and not (path.is_file() and path.suffix.lower() == ".npz"):
        raise DataError(f"{path} is not an .npz of windows", "pass .npz files with the windows as x (or --text)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if _is_image(p, path))
        if not files:
            raise DataError(f"folder {path} holds no images", f"add {', '.join(IMAGE_SUFFIXES)} files to it")
        return path, files
    if path.is_file() and path.suffix.lower() == ".npz":
        (x,) = read_npz(path, keys=("x",))
        samples = check_inputs(np.asarray(x), manifest, what=f"{path} x")
        if not len(samples):
            raise DataError(f"{path} x holds no samples", "save at least one image or window as x")
        return path, samples
    if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
        return path, [path]
    if path.is_file():
        raise DataError(
            f"{path} is neither an image ({', '.join(IMAGE_SUFFIXES)}) nor an .npz",
            "pass image files, folders of images or .npz files with images as x",
        )
    raise DataError(f"{path} does not exist", "pass image files, folders of images or .npz files")


def _is_image(path: Path, folder: Path) -> bool:
    """An image file inside `folder`, not hidden and not inside a hidden folder."""
    inside = path.relative_to(folder).parts
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file() and not any(p.startswith(".") for p in inside)


def _image_input(path: Path, engine: Engine) -> np.ndarray:
    """One image file as a (1, C, H, W) model input."""
    pixels = read_image(path, engine.manifest)  # (H, W, C)
    return normalize(pixels.transpose(2, 0, 1)[None], engine.manifest.input)


def bundle_vocabulary(engine: Engine) -> text.Vocabulary:
    """The text bundle's vocabulary, refused when it is not the one its manifest names or does not fit the model."""
    manifest = engine.manifest
    if task_kind(manifest) != NEXT_WORD:
        name = manifest.model.get("name", "model")
        raise UsageError(f"--text needs a next-word bundle, and this one's {name} is not", "pass image or window files")
    vocabulary = text.load_vocabulary(engine.bundle_dir, manifest.task)
    if len(vocabulary) != manifest.num_classes:
        raise BundleError(
            f"vocab.json holds {len(vocabulary)} words and the model predicts {manifest.num_classes}",
            "copy vocab.json from the same export as manifest.json",
        )
    return vocabulary


def next_words(engine: Engine, phrase: str, k: int) -> tuple[tuple[int, str, float], ...]:
    """The `k` most likely next words of `phrase` as (id, word, probability), most likely first (ties: lower id);
    <pad>, <oov> and <bos> are never suggested."""
    vocabulary = bundle_vocabulary(engine)
    context = text.phrase_context(phrase, vocabulary, int(engine.manifest.task["seq_len"]))
    probabilities = engine.predict(context[None])[0]
    candidates = np.setdiff1d(np.arange(len(probabilities)), NEVER_SUGGESTED)
    order = candidates[np.argsort(-probabilities[candidates], kind="stable")][:k]
    return tuple((int(i), vocabulary.words[i], float(probabilities[i])) for i in order)
