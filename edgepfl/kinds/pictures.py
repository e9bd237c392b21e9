"""Image files as a model's pixels: a folder of class folders, one image file, and the one resize both devices use.

The browser page repeats each rule line for line (device_runtime/web/src/data.js labelFolderFiles, preprocess.js),
and fixtures written here pin both sides.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from edgepfl.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def read_image_folder(folder: Path, shape: Sequence[int], class_labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, H, W, C) at the model's (C, H, W) `shape`, labelled by their class folders
    (`label_folder_files`)."""
    root = folder.resolve().name
    images, labels = [], []
    for parts, label in label_folder_files(root, _folder_files(folder), shape, class_labels):
        images.append(read_image(folder.joinpath(*parts), shape, shown="/".join((root, *parts))))
        labels.append(label)
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def label_folder_files(
    root: str, files: Iterable[tuple[str, ...]], shape: Sequence[int], class_labels: Sequence[str]
) -> list[tuple[tuple[str, ...], int]]:
    """The images of an image folder and their labels, by the one rule the browser page follows too.

    `files` are paths inside the folder `root`, as parts. Hidden entries (a part starting with ".") and files
    that are not images are ignored. Every image sits directly in a class folder, and a class folder is named
    as its class: the bundle's class names, or its index 0..num_classes-1 when it has none (Manifest.class_labels).
    Anything else is refused with one line (an image outside the class folders or deeper in one, a folder named
    as no class, a class folder without images), checked in this order, in path order (Unicode code points).
    device_runtime/web/src/data.js `labelFolderFiles` is the same rule, line for line.
    """
    labels = tuple(class_labels)
    image_mode(shape)  # a model that takes no images is refused first
    visible = sorted(parts for parts in files if not any(part.startswith(".") for part in parts))
    images = [parts for parts in visible if parts[-1].lower().endswith(IMAGE_SUFFIXES)]
    for parts in images:
        if len(parts) == 1:
            raise DataError(
                f"{root}/{parts[0]} is outside the class folders",
                f"move it into the folder of its class: {root}/<class>/{parts[0]}",
            )
        if len(parts) > 2:
            raise DataError(
                f"{root}/{'/'.join(parts)} is in a folder inside class folder {parts[0]}",
                "put each class's images directly in its class folder",
            )
    index = {unicodedata.normalize("NFC", name): label for label, name in enumerate(labels)}
    for folder in sorted({parts[0] for parts in visible if len(parts) > 1}):
        if unicodedata.normalize("NFC", folder) not in index:
            raise DataError(f"folder {root}/{folder} is not named as a class of this model", _naming_fix(labels))
        if not any(parts[0] == folder for parts in images):
            raise DataError(f"class folder {root}/{folder} holds no images", "add images (.png, .jpg, …) or remove it")
    if not images:
        raise DataError(f"{root} has no class folders with images", _naming_fix(labels))
    return [(parts, index[unicodedata.normalize("NFC", parts[0])]) for parts in images]


def read_image(path: Path, shape: Sequence[int], shown: str | None = None) -> np.ndarray:
    """One image file as uint8 (H, W, C) pixels at the model input: converted to grey ('L') or colour ('RGB') as
    the model takes (Pillow's formulas, which the browser page repeats), then resized by `resize_image`."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading images needs Pillow", "pip install pillow, or pass an .npz") from None
    channels, height, width = shape
    mode = image_mode(shape)
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert(mode), dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"{shown or path} is not a readable image ({exc})", "remove or replace the file") from None
    return resize_image(pixels.reshape(pixels.shape[0], pixels.shape[1], channels), height, width)


def image_mode(shape: Sequence[int]) -> str:
    """Pillow's mode of the model's (C, H, W) images: 'L' (grey) or 'RGB'; other channel counts take no image files."""
    channels = shape[0]
    if channels not in (1, 3):
        raise DataError(f"the model takes {channels}-channel images", "use an .npz for this model")
    return "L" if channels == 1 else "RGB"


def _folder_files(folder: Path) -> list[tuple[str, ...]]:
    """Every file under `folder` as its path's parts, not looking inside hidden folders (the browser lists files
    only, so an empty folder is never seen by either device)."""
    files = []
    for top, dirs, names in os.walk(folder):
        dirs[:] = [name for name in dirs if not name.startswith(".")]
        inside = Path(top).relative_to(folder).parts
        files += [(*inside, name) for name in names]
    return files


def _naming_fix(labels: tuple[str, ...]) -> str:
    """How to name class folders: by the class names, or by index when they are "0".."n-1" (no names)."""
    if labels != tuple(str(index) for index in range(len(labels))):
        more = ", …" if len(labels) > 12 else ""
        return f"name each class folder exactly as its class: {', '.join(labels[:12])}{more}"
    return (
        f"name each class folder by its class index, 0 to {len(labels) - 1} "
        "(the bundle has no class names: `edgepfl export --class-names` adds them)"
    )


def resize_image(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 (h, w, c) pixels resampled to (height, width, c) with the one resize the browser device repeats.

    Separable triangle (bilinear) filter with pixel-centre alignment, widened by the scale factor when
    shrinking so every source pixel counts (Pillow's BILINEAR with antialiasing), computed in float64
    with taps summed in ascending order, then rounded half up to uint8. device_runtime/web/src/preprocess.js
    performs the same operations in the same order, so both produce identical pixels.
    """
    if pixels.dtype != np.uint8 or pixels.ndim != 3:
        raise DataError(
            f"cannot resize pixels of dtype {pixels.dtype} and shape {pixels.shape}", "pass uint8 (h, w, c) pixels"
        )
    if pixels.shape[:2] == (height, width):
        return pixels
    rows = _resample_axis(pixels.astype(np.float64), height, axis=0)
    both = _resample_axis(rows, width, axis=1)
    return np.clip(np.floor(both + 0.5), 0, 255).astype(np.uint8)


def _resample_axis(values: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One pass of `resize_image` along `axis`: each output is a normalised, in-order sum of its taps."""
    taps, weights = resize_taps(values.shape[axis], out_size)
    moved = np.moveaxis(values, axis, 0)
    result = np.zeros((out_size, *moved.shape[1:]), dtype=np.float64)
    for k in range(taps.shape[1]):  # in tap order: the browser accumulates the same way
        result += weights[:, k].reshape(-1, *([1] * (moved.ndim - 1))) * moved[taps[:, k]]
    return np.moveaxis(result, 0, axis)


def resize_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Source indices and normalised weights (out_size, taps) of `resize_image` along one axis; unused taps weigh 0."""
    scale = in_size / out_size
    support = max(scale, 1.0)  # the triangle's half-width in source pixels
    centres = (np.arange(out_size) + 0.5) * scale
    first = np.maximum((centres - support + 0.5).astype(np.int64), 0)
    last = np.minimum((centres + support + 0.5).astype(np.int64), in_size)
    count = int((last - first).max())
    taps = np.minimum(first[:, None] + np.arange(count)[None, :], in_size - 1)
    raw = np.maximum(0.0, 1.0 - np.abs((first[:, None] + np.arange(count)[None, :] - centres[:, None] + 0.5) / support))
    raw[first[:, None] + np.arange(count)[None, :] >= last[:, None]] = 0.0
    total = np.zeros(out_size, dtype=np.float64)
    for k in range(count):  # in tap order, as the browser sums
        total += raw[:, k]
    return taps, raw / total[:, None]
