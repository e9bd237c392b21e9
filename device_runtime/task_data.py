"""A person's own text and sensor recordings, read for a text or a sensor bundle (`device train/run --data`).

Text: a UTF-8 `.txt` file, a line an utterance, tokenized with the bundle's vocab.json (checked against the
manifest's sha256). Its next-word samples stay in time order: the last `val_fraction` of them is held out, so no
held-out context was trained on. Sensors: an `.npz` with `x` (N, C, T) readings, `y` (N,) labels and `channels`
(C names), or a CSV of fixed windows (docs/device.md): a header `window,label,<channel>,...`, then one row per
reading, T consecutive rows per window. The channels must be the bundle's, by name and in its order.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from edgepfl.data import LocalData, check_samples, make_local_data, scored
from edgepfl.errors import DataError
from edgepfl.manifest import Manifest
from edgepfl.text import check_text, load_vocabulary, next_word_samples, read_text

MIN_DEVICE_WORDS = 10  # fewer words make too few samples to train on and to hold some out
CSV_COLUMNS = ("window", "label")  # the columns before the channels in a sensor CSV


def task_kind(manifest: Manifest) -> str:
    """The bundle's kind of sample: "next-word", "sensor", or "image" (no task entry)."""
    return str(manifest.task.get("kind") or "image")


def load_text_data(path: Path, manifest: Manifest, bundle: Path, val_fraction: float) -> LocalData:
    """A .txt file's next-word samples, tokenized with the bundle's vocabulary; the last `val_fraction` held out."""
    if path.suffix.lower() != ".txt":
        raise DataError(f"{path} is not a .txt file; a text bundle trains on UTF-8 text", "pass a .txt file")
    vocabulary = load_vocabulary(bundle, manifest.task)
    lines = read_text(path).splitlines()
    check_text(lines, str(path), MIN_DEVICE_WORDS)
    x, y = next_word_samples(lines, vocabulary, int(manifest.task["seq_len"]))
    samples, labels = check_samples(x, y, manifest, what=str(path))
    cut = len(labels) - min(int(round(len(labels) * val_fraction)), len(labels) - 1)
    held_out = scored(np.arange(cut, len(labels)), labels, manifest)
    return LocalData(samples, labels, np.arange(cut), held_out, manifest.input)


def load_sensor_data(path: Path, manifest: Manifest, val_fraction: float, seed: int) -> LocalData:
    """Sensor windows from an .npz or a CSV, their channels checked against the bundle's, split like images."""
    if path.suffix.lower() == ".csv":
        x, y, channels = read_sensor_csv(path, manifest)
    elif path.suffix.lower() == ".npz":
        from edgepfl.device_runtime.data import read_npz

        x, y, names = read_npz(path, ("x", "y", "channels"))
        channels = [str(name) for name in np.asarray(names).reshape(-1)]
    else:
        raise DataError(f"{path} is neither .npz nor .csv", "save the windows as .npz (x, y, channels) or CSV")
    check_channels(channels, manifest, str(path))
    return make_local_data(x, y, manifest, val_fraction, seed, what=str(path))


def check_channels(channels: list[str], manifest: Manifest, source: str) -> None:
    """Refuse, in one line, channels other than the bundle's (by name, in its order)."""
    expected = [str(name) for name in manifest.task.get("channels", [])]
    if channels == expected:
        return
    missing = [name for name in expected if name not in channels]
    extra = [name for name in channels if name not in expected]
    if missing or extra:
        problem = f"lacks channel {missing[0]!r}" if missing else f"has channel {extra[0]!r}, which the model lacks"
        raise DataError(f"{source} {problem} (the model reads {', '.join(expected)})", "record the bundle's channels")
    raise DataError(
        f"{source} has the model's channels in another order ({', '.join(channels)})",
        f"order them as the bundle does: {', '.join(expected)}",
    )


def read_sensor_csv(path: Path, manifest: Manifest) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Windows (N, C, T) float32, labels (N,) and channel names of a sensor CSV (docs/device.md)."""
    rows = list(csv.reader(io.StringIO(read_text(path))))
    if not rows or [cell.strip() for cell in rows[0][:2]] != list(CSV_COLUMNS):
        raise DataError(
            f"{path} does not start with the header window,label,<channel>,...", "write the header row first"
        )
    channels = [cell.strip() for cell in rows[0][2:]]
    check_channels(channels, manifest, str(path))
    steps = int(manifest.task.get("window") or manifest.input.shape[-1])
    classes = {name: index for index, name in enumerate(manifest.class_labels)}
    windows: dict[str, list[list[str]]] = {}
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(rows[0]):
            raise DataError(f"{path} line {number} has {len(row)} cells, the header {len(rows[0])}", "fill every cell")
        windows.setdefault(row[0].strip(), []).append(row)
    if not windows:
        raise DataError(f"{path} holds no readings", "add one row per reading under the header")
    x, y = [], []
    for window, readings in windows.items():
        if len(readings) != steps:
            raise DataError(
                f"{path}: window {window} has {len(readings)} readings, the model takes {steps}",
                f"cut the recording into windows of {steps} readings",
            )
        labels = {row[1].strip() for row in readings}
        if len(labels) != 1:
            raise DataError(f"{path}: window {window} has more than one label", "give each window one label")
        label = labels.pop()
        if label not in classes and not label.isdigit():
            raise DataError(f"{path}: window {window} has label {label!r}", f"use one of: {', '.join(classes)}")
        try:
            values = np.array([[float(cell) for cell in row[2:]] for row in readings], dtype=np.float32)
        except ValueError:
            raise DataError(f"{path}: window {window} has a reading that is not a number", "write numbers") from None
        x.append(values.T)
        y.append(classes.get(label, int(label) if label.isdigit() else -1))
    return np.stack(x), np.asarray(y, dtype=np.int64), channels
