"""What a device predicts with a text or sensor bundle: the next words of a phrase, and sensor or token windows.

A text bundle's model reads the last `seq_len` token ids (its vocab.json's, after <bos>) and gives one
probability per word of the vocabulary; the suggestions leave out the tokens nobody types (<pad>, <oov>, <bos>).
A sensor bundle's model reads (channels, time) windows, normalised per channel with the manifest's mean and std.
"""

from __future__ import annotations

import numpy as np

from edgepfl import text
from edgepfl.device_runtime.engine import Engine
from edgepfl.errors import BundleError, DataError, UsageError
from edgepfl.manifest import InputSpec, Manifest

NEXT_WORD, SENSOR = "next-word", "sensor"
NEVER_SUGGESTED = (text.PAD_ID, text.OOV_ID, text.BOS_ID)


def task_kind(manifest: Manifest) -> str:
    """The bundle's kind of sample: "next-word", "sensor", or "" for images."""
    return str(manifest.task.get("kind", ""))


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


def phrase_context(phrase: str, vocabulary: text.Vocabulary, seq_len: int) -> np.ndarray:
    """The model input (1, seq_len) int64 of a phrase: <bos> and its words' ids, the last seq_len, left-padded."""
    ids = np.concatenate([[text.BOS_ID], vocabulary.encode(text.tokenize(phrase))])
    return text.context(ids, seq_len)[None]


def next_words(engine: Engine, phrase: str, k: int) -> tuple[tuple[int, str, float], ...]:
    """The `k` most likely next words of `phrase` as (id, word, probability), most likely first (ties: lower id)."""
    vocabulary = bundle_vocabulary(engine)
    probabilities = engine.predict(phrase_context(phrase, vocabulary, int(engine.manifest.task["seq_len"])))[0]
    candidates = np.setdiff1d(np.arange(len(probabilities)), NEVER_SUGGESTED)
    order = candidates[np.argsort(-probabilities[candidates], kind="stable")][:k]
    return tuple((int(i), vocabulary.words[i], float(probabilities[i])) for i in order)


def window_inputs(x: np.ndarray, manifest: Manifest, what: str) -> np.ndarray:
    """An .npz's `x` as the model input of a text or sensor bundle: token windows (N, seq_len) of valid ids, or
    sensor windows (N, C, T), finite, normalised per channel."""
    spec = manifest.input
    shape = tuple(spec.shape)
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != shape:
        unit = "windows of token ids" if task_kind(manifest) == NEXT_WORD else "channels × time windows"
        raise DataError(
            f"{what} has shape {tuple(x.shape)}; this bundle reads (N, {', '.join(map(str, shape))}) {unit}",
            f"save x with shape (N, {', '.join(map(str, shape))})",
        )
    if not len(x):
        raise DataError(f"{what} holds no window", "save at least one window as x")
    if spec.dtype.startswith("int"):
        if not np.issubdtype(x.dtype, np.integer) or x.min() < 0 or x.max() >= manifest.num_classes:
            raise DataError(
                f"{what} holds values that are not token ids 0..{manifest.num_classes - 1}",
                "save the ids of the bundle's vocab.json (edgepfl.text) as integers",
            )
        return np.ascontiguousarray(x, dtype=np.int64)
    return normalized_windows(x, spec, what)


def normalized_windows(x: np.ndarray, spec: InputSpec, what: str) -> np.ndarray:
    """Sensor windows (N, C, T) as float32 model input, (x - mean[c]) / std[c]; NaN or infinity refused."""
    values = np.asarray(x, dtype=np.float32)
    if not np.isfinite(values).all():
        bad = int(np.argwhere(~np.isfinite(values))[0][0])
        raise DataError(f"{what} window {bad} holds NaN or infinity", "drop or repair the windows with gaps")
    if spec.mean:
        mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, -1, 1)
        std = np.asarray(spec.std, dtype=np.float32).reshape(1, -1, 1)
        values = (values - mean) / std
    return np.ascontiguousarray(values)
