"""Local data as a model sees it: validation, normalisation, a seeded train/held-out split and batches.

numpy only: the device runtime and the simulator share this module. Images are kept in their
stored dtype (uint8 stays uint8) and normalised per batch, so a device holds 1 byte per pixel.
A sample is what the manifest's input layout says: an image (NCHW), a window of token ids (`tokens`,
int64 (N, seq_len), edgepfl/text.py) or a window of sensor channels over time (`CT`, float (N, C, T)).

Pixel convention: uint8 pixels are divided by 255; float pixels are taken as already scaled to
[0, 1] (values outside it are refused). Both are then normalised with the manifest's per-channel
mean and std. Arrays may be NCHW or NHWC; the layout is detected from the manifest's input shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edgepfl.errors import DataError
from edgepfl.manifest import InputSpec, Manifest
from edgepfl.text import SPECIALS, counted

# float pixels may come from JPEG decoding or resampling that overshoots [0, 1] by a rounding error
_FLOAT_PIXEL_SLACK = 1e-3
TOKEN_LAYOUT, SENSOR_LAYOUT = "tokens", "CT"  # InputSpec.layout of a text and of a sensor bundle


def to_model_layout(x: np.ndarray, input_spec: InputSpec, what: str = "x") -> np.ndarray:
    """The samples as the model takes them (images as (N, C, H, W), without copying when they already are; token
    and sensor windows as they are); DataError when they cannot fit."""
    if input_spec.layout in (TOKEN_LAYOUT, SENSOR_LAYOUT):
        return _windows(x, input_spec, what)
    channels, height, width = input_spec.shape
    if x.ndim == 3 and channels == 1 and x.shape[1:] == (height, width):
        return x[:, None, :, :]
    if x.ndim == 4:
        nchw = x.shape[1:] == (channels, height, width)
        nhwc = x.shape[1:] == (height, width, channels)
        if nchw and (not nhwc or input_spec.layout == "NCHW"):
            return x
        if nhwc:
            return x.transpose(0, 3, 1, 2)
        for size, channel_axis in (((x.shape[2], x.shape[3]), 1), ((x.shape[1], x.shape[2]), 3)):
            if x.shape[channel_axis] != channels and size == (height, width):
                raise DataError(
                    f"{what} has {x.shape[channel_axis]} channel(s) per image, the model takes {channels}",
                    "convert the images (grey <-> colour) or export the model with matching --in-channels",
                )
        for size, channel_axis in (((x.shape[2], x.shape[3]), 1), ((x.shape[1], x.shape[2]), 3)):
            if x.shape[channel_axis] == channels:
                raise DataError(
                    f"{what} images are {size[0]}x{size[1]}, the model takes {height}x{width}",
                    f"resize the images or export the model with --input-size {size[0]}",
                )
    raise DataError(
        f"{what} has shape {tuple(x.shape)}, the model takes images of {(channels, height, width)} (NCHW) "
        f"or {(height, width, channels)} (NHWC)",
        "save x as an (N, C, H, W) or (N, H, W, C) array",
    )


def _windows(x: np.ndarray, input_spec: InputSpec, what: str) -> np.ndarray:
    """Token windows (N, seq_len) or sensor windows (N, C, T) of exactly the model's shape."""
    if x.ndim == len(input_spec.shape) + 1 and x.shape[1:] == tuple(input_spec.shape):
        return x
    if input_spec.layout == TOKEN_LAYOUT:
        raise DataError(
            f"{what} has shape {tuple(x.shape)}, the model reads windows of {input_spec.shape[0]} token ids",
            "make the windows with edgepfl.text.next_word_samples, or pass the text file itself",
        )
    channels, steps = input_spec.shape
    if x.ndim == 3 and x.shape[1] != channels:
        raise DataError(
            f"{what} has {x.shape[1]} channel(s) per window, the model takes {channels}",
            "record the channels the bundle names (manifest.json: task.channels)",
        )
    if x.ndim == 3:
        raise DataError(
            f"{what} windows are {x.shape[2]} samples long, the model takes {steps}",
            f"cut the recordings into windows of {steps} samples",
        )
    raise DataError(f"{what} has shape {tuple(x.shape)}, expected (N, {channels}, {steps})", "save x as (N, C, T)")


def check_samples(
    x: np.ndarray, y: np.ndarray, manifest: Manifest, what: str = "data"
) -> tuple[np.ndarray, np.ndarray]:
    """The samples in the model's layout and their int64 labels, every value checked; one DataError otherwise."""
    samples = check_inputs(x, manifest, what=f"{what} x")
    return samples, check_labels(np.asarray(y), manifest.num_classes, len(samples), what=f"{what} y")


def check_inputs(x: np.ndarray, manifest: Manifest, what: str = "x") -> np.ndarray:
    """The samples (no labels) in the model's layout, as stored, every value checked; one DataError otherwise."""
    samples = to_model_layout(np.asarray(x), manifest.input, what=what)
    if manifest.input.layout == TOKEN_LAYOUT:
        check_token_ids(samples, int(manifest.task.get("vocab_size") or manifest.num_classes), what)
    elif manifest.input.layout == SENSOR_LAYOUT:
        check_readings(samples, what)
    else:
        check_pixels(samples, what=what)
    return samples


def check_token_ids(x: np.ndarray, vocab_size: int, what: str = "x") -> None:
    """Integer token ids of the bundle's vocabulary; anything else is refused with the fix."""
    if x.dtype.kind not in "iu":
        raise DataError(f"{what} has dtype {x.dtype}, token ids are integers", "tokenize with the bundle's vocab.json")
    if x.size and (x.min() < 0 or x.max() >= vocab_size):
        raise DataError(
            f"{what} holds token ids outside 0..{vocab_size - 1} of the bundle's vocabulary",
            "tokenize with the bundle's vocab.json",
        )


def check_readings(x: np.ndarray, what: str = "x") -> None:
    """Finite real sensor readings; NaN, Inf or non-numbers are refused with the fix."""
    if x.dtype.kind not in "iuf":
        raise DataError(f"{what} has dtype {x.dtype}, sensor readings are numbers", "save the readings as float32")
    if x.dtype.kind == "f" and x.size and not np.isfinite(x).all():
        window = int(np.flatnonzero(~np.isfinite(x).reshape(len(x), -1).all(axis=1))[0])
        raise DataError(
            f"{what} window {window} holds NaN or Inf readings",
            "drop or fill the gaps in the recording (e.g. interpolate) before cutting windows",
        )


def check_pixels(x: np.ndarray, what: str = "x") -> None:
    """uint8 pixels, or floats in [0, 1]; anything else is refused with the fix."""
    if x.dtype == np.uint8:
        return
    if x.dtype.kind != "f":
        raise DataError(f"{what} has dtype {x.dtype}", "store images as uint8 pixels or floats in [0, 1]")
    if x.size and not np.isfinite(x).all():
        raise DataError(f"{what} contains NaN or Inf", "clean the images before training")
    if x.size and (x.min() < -_FLOAT_PIXEL_SLACK or x.max() > 1 + _FLOAT_PIXEL_SLACK):
        raise DataError(
            f"{what} holds floats in [{x.min():.3g}, {x.max():.3g}]; float pixels must be in [0, 1]",
            "store uint8 pixels or divide by 255 (do not apply mean/std yourself: the manifest's are used)",
        )


def check_labels(y: np.ndarray, num_classes: int, count: int, what: str = "y") -> np.ndarray:
    """Labels as int64 class indices in 0..num_classes-1, one per image; DataError otherwise."""
    if y.ndim != 1 or len(y) != count:
        raise DataError(
            f"{what} has shape {tuple(y.shape)}, expected ({count},): one class index per image",
            "store labels as a 1-D array of class indices",
        )
    if y.dtype.kind == "f":
        if not np.array_equal(y, np.round(y)):
            raise DataError(f"{what} holds non-integer values", "store labels as class indices, not one-hot or scores")
    elif y.dtype.kind not in "iub":
        raise DataError(f"{what} has dtype {y.dtype}", "store labels as integer class indices")
    labels = y.astype(np.int64)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        first = int(bad[0])
        raise DataError(
            f"{what}[{first}] = {labels[first]} is not a class of this model (0..{num_classes - 1}); "
            f"{len(bad)} label(s) are out of range",
            f"relabel the data or export the model with --num-classes {int(labels.max()) + 1}",
        )
    return labels


def normalize(x: np.ndarray, input_spec: InputSpec) -> np.ndarray:
    """Model input: images float32 NCHW, uint8 / 255 (floats taken as [0, 1]), then (x - mean) / std per channel;
    sensor windows float32 (x - mean) / std per channel; token ids int64 as they are."""
    if input_spec.layout == TOKEN_LAYOUT:
        return np.ascontiguousarray(to_model_layout(x, input_spec), dtype=np.int64)
    images = to_model_layout(x, input_spec)
    scaled = images.astype(np.float32)
    if images.dtype == np.uint8:
        scaled *= np.float32(1.0 / 255.0)
    if input_spec.mean:
        per_channel = (1, -1) + (1,) * (images.ndim - 2)
        mean = np.asarray(input_spec.mean, dtype=np.float32).reshape(per_channel)
        std = np.asarray(input_spec.std, dtype=np.float32).reshape(per_channel)
        scaled -= mean
        scaled /= std
    return np.ascontiguousarray(scaled)


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

    images: np.ndarray  # (N, C, H, W) as stored: uint8 pixels or floats in [0, 1]
    labels: np.ndarray  # (N,) int64
    train_index: np.ndarray
    val_index: np.ndarray
    input_spec: InputSpec

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
        return normalize(self.images[index], self.input_spec), self.labels[index]


def make_local_data(
    x: np.ndarray, y: np.ndarray, manifest: Manifest, val_fraction: float, seed: int, what: str = "data"
) -> LocalData:
    """Check samples and labels against the manifest and split them; every mismatch is one DataError."""
    samples, labels = check_samples(x, y, manifest, what)
    train_index, val_index = split_train_val(len(samples), val_fraction, seed)
    return LocalData(samples, labels, train_index, scored(val_index, labels, manifest), manifest.input)


def metric_description(manifest: Manifest) -> str:
    """What a held-out accuracy of this bundle counts, in words (results.json's info)."""
    ignored = manifest.task.get("metric_ignores") or ()
    if not ignored:
        return "top-1 accuracy over every held-out sample"
    names = ", ".join(SPECIALS[i] if 0 <= i < len(SPECIALS) else f"id {i}" for i in ignored)
    return f"top-1 accuracy, held-out targets {names} not counted"


def scored(index: np.ndarray, labels: np.ndarray, manifest: Manifest) -> np.ndarray:
    """The held-out samples whose target counts towards accuracy: all, but for a task whose manifest lists
    `metric_ignores` (FedAlt's next-word accuracy: <pad> and <oov> targets do not count)."""
    ignored = manifest.task.get("metric_ignores") or ()
    return index[counted(labels[index], ignored)] if len(ignored) else index
