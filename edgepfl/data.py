"""Local data as a model sees it: a device's own data read by its bundle's kind, labels checked, a train/held-out
split and normalised batches.

numpy only: the device runtime and the simulator share this module. What a sample is, how a device's files are read,
checked and normalised, is its kind's (edgepfl/kinds/); samples are kept as stored (uint8 pixels stay uint8) and
normalised a batch at a time, so a device holds 1 byte per pixel.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepfl.errors import DataError
from edgepfl.kinds import SampleKind
from edgepfl.manifest import Manifest
from edgepfl.text import SPECIALS, counted


def load_device_data(
    path: str | os.PathLike, manifest: Manifest, val_fraction: float, seed: int, bundle: str | os.PathLike = ""
) -> LocalData:
    """A device's own data (`device train/run --data`), read by the bundle's kind (a text bundle's vocabulary from
    the bundle folder `bundle`), checked against the manifest and split into train and held-out parts."""
    samples = manifest.kind.read(Path(path), Path(bundle), manifest.class_labels)
    return make_local_data(samples.x, samples.y, manifest, val_fraction, seed, what=str(path))


def check_samples(
    x: np.ndarray, y: np.ndarray, manifest: Manifest, what: str = "data"
) -> tuple[np.ndarray, np.ndarray]:
    """The samples in the model's layout and their int64 labels, every value checked; one DataError otherwise."""
    samples = check_inputs(x, manifest, what=f"{what} x")
    labels = check_labels(np.asarray(y), manifest.num_classes, len(samples), f"{what} y", manifest.kind.target_shape)
    return samples, labels


def check_inputs(x: np.ndarray, manifest: Manifest, what: str = "x") -> np.ndarray:
    """The samples (no labels) in the model's layout, as stored, every value checked; one DataError otherwise."""
    return manifest.kind.check_inputs(np.asarray(x), what)


def check_labels(
    y: np.ndarray, num_classes: int, count: int, what: str = "y", target_shape: tuple[int, ...] = ()
) -> np.ndarray:
    """Labels as int64 class indices in 0..num_classes-1, one per sample (a next-word sequence: one per position,
    `target_shape`); DataError otherwise."""
    if y.shape != (count, *target_shape):
        expected = ", ".join(map(str, (count, *target_shape))) + ("," if not target_shape else "")
        each = "one class index per sample" if not target_shape else f"{target_shape[0]} next tokens per sample"
        raise DataError(
            f"{what} has shape {tuple(y.shape)}, expected ({expected}): {each}",
            "store labels as a 1-D array of class indices"
            if not target_shape
            else "make them with edgepfl.text.next_word_samples, or pass the text file itself",
        )
    if y.dtype.kind == "f":
        if not np.array_equal(y, np.round(y)):
            raise DataError(f"{what} holds non-integer values", "store labels as class indices, not one-hot or scores")
    elif y.dtype.kind not in "iub":
        raise DataError(f"{what} has dtype {y.dtype}", "store labels as integer class indices")
    labels = y.astype(np.int64)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        first = tuple(int(i) for i in np.unravel_index(int(bad[0]), labels.shape))
        where = ", ".join(map(str, first))
        raise DataError(
            f"{what}[{where}] = {labels[first]} is not a class of this model (0..{num_classes - 1}); "
            f"{len(bad)} label(s) are out of range",
            f"relabel the data or export the model with --num-classes {int(labels.max()) + 1}",
        )
    return labels


def split_train_val(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of n sample indices into (train, held-out); both sorted, train never empty."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"validation fraction {val_fraction} is outside [0, 1)", "pass e.g. --val-fraction 0.2")
    if n < 1:
        raise DataError("the data holds no samples", "pass a data set with at least one image")
    n_val = min(int(round(n * val_fraction)), n - 1)
    if val_fraction > 0 and n >= 2:
        n_val = max(n_val, 1)
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def split_time_order(n: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """n samples in time order split into (train, held-out): the last `val_fraction` held out, at least one trains,
    so no held-out context was trained on (the page's text.js timeOrderSplit is the same)."""
    if n < 1:
        raise DataError("the data holds no samples", "pass a data set with at least one sample")
    cut = n - min(int(round(n * val_fraction)), n - 1)
    return np.arange(cut), np.arange(cut, n)


def iterate_batches(n: int, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """Positions 0..n-1 in batches, shuffled by (seed, epoch); the last partial batch is included."""
    if batch_size < 1:
        raise DataError(f"batch size {batch_size} is not positive", "use a batch size of at least 1")
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def num_batches(n: int, batch_size: int) -> int:
    """How many batches `iterate_batches` yields for n samples."""
    return -(-n // batch_size)


@dataclass(frozen=True)
class LocalData:
    """A device's (or a simulated client's) images and labels with its train/held-out split."""

    images: np.ndarray  # the samples as stored: (N, C, H, W) uint8 pixels or floats in [0, 1], token ids, readings
    labels: np.ndarray  # (N,) int64, or (N, seq_len): a next-word sequence's target at each position
    train_index: np.ndarray
    val_index: np.ndarray
    kind: SampleKind  # normalises a batch

    @property
    def num_train(self) -> int:
        """Training samples: the count an upload quotes."""
        return len(self.train_index)

    @property
    def num_val(self) -> int:
        """Held-out samples."""
        return len(self.val_index)

    def train_batches(self, batch_size: int, seed: int, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Normalised (x, y) training batches, shuffled by (seed, epoch)."""
        for positions in iterate_batches(self.num_train, batch_size, seed, epoch):
            yield self._batch(self.train_index[positions])

    def train_batches_in_order(
        self, batch_size: int, full_only: bool = False
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Normalised (x, y) training batches in stored order; `full_only` drops a last partial batch."""
        end = self.num_train - self.num_train % batch_size if full_only else self.num_train
        for start in range(0, end, batch_size):
            yield self._batch(self.train_index[start : start + batch_size])

    def val_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Normalised (x, y) held-out batches in a fixed order."""
        for start in range(0, self.num_val, batch_size):
            yield self._batch(self.val_index[start : start + batch_size])

    def _batch(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.kind.normalize(self.images[index]), self.labels[index]


def make_local_data(
    x: np.ndarray, y: np.ndarray, manifest: Manifest, val_fraction: float, seed: int, what: str = "data"
) -> LocalData:
    """Check samples and labels against the manifest and split them as the kind holds out (the end of the data in
    time order, or a seeded draw); every mismatch is one DataError."""
    samples, labels = check_samples(x, y, manifest, what)
    split = split_time_order(len(samples), val_fraction) if manifest.kind.held_out_last else None
    train_index, val_index = split or split_train_val(len(samples), val_fraction, seed)
    return LocalData(samples, labels, train_index, scored(val_index, labels, manifest), manifest.kind)


def metric_description(manifest: Manifest) -> str:
    """What a held-out accuracy of this bundle counts, in words (results.json's info)."""
    ignored = manifest.kind.metric_ignores
    if not ignored:
        return "top-1 accuracy over every held-out sample"
    names = ", ".join(SPECIALS[i] if 0 <= i < len(SPECIALS) else f"id {i}" for i in ignored)
    return f"top-1 accuracy, held-out targets {names} not counted"


def scored(index: np.ndarray, labels: np.ndarray, manifest: Manifest) -> np.ndarray:
    """The held-out samples with a target that counts towards accuracy: all, but for a task whose manifest lists
    `metric_ignores` (FedAlt's next-word accuracy: <pad> and <oov> targets do not count; within a sequence the
    engines weigh each position by `kind.target_weights`)."""
    ignored = manifest.kind.metric_ignores
    if not len(ignored):
        return index
    counts = counted(labels[index], ignored)
    return index[counts.reshape(len(index), -1).any(axis=1)]
