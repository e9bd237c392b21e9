"""Reading a device's own data from disk: an .npz file (`x`, `y`) or an image folder, one sub-folder per class."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from edgepfl.data import LocalData, make_local_data
from edgepfl.errors import DataError
from edgepfl.manifest import Manifest

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
_GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")


def load_device_data(path: str | os.PathLike, manifest: Manifest, val_fraction: float, seed: int) -> LocalData:
    """The device's data checked against the manifest and split into train and held-out parts."""
    source = Path(path)
    if source.is_dir():
        x, y = read_image_folder(source, manifest)
    elif source.is_file():
        x, y = read_npz(source)
    else:
        raise DataError(f"data path {source} does not exist", "pass an .npz file or an image folder")
    return make_local_data(x, y, manifest, val_fraction, seed, what=str(source))


def read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Arrays `x` and `y` of an .npz file (no pickled objects)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ("x", "y") if key not in archive.files]
            if missing:
                raise DataError(
                    f"{path} has no array {missing[0]!r} (it holds {', '.join(archive.files) or 'nothing'})",
                    "save the images as `x` and the labels as `y`: np.savez(path, x=images, y=labels)",
                )
            return archive["x"], archive["y"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # numpy raises EOFError on an empty file
        raise DataError(
            f"{path} is not a readable .npz file ({exc or type(exc).__name__})", "pass an .npz written by numpy.savez"
        ) from None


def read_image_folder(folder: Path, manifest: Manifest) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, H, W, C) and labels from `folder/<class>/<image>`; classes sorted by name."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading an image folder needs Pillow", "pip install pillow, or pass an .npz") from None
    class_dirs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise DataError(f"{folder} has no class sub-folders", "put each class's images in a sub-folder of its own")
    if len(class_dirs) > manifest.num_classes:
        raise DataError(
            f"{folder} has {len(class_dirs)} class folders, the model has {manifest.num_classes} classes",
            f"remove extra folders or export the model with --num-classes {len(class_dirs)}",
        )
    channels, height, width = manifest.input.shape
    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise DataError(f"the model takes {channels}-channel images", "use an .npz for this model")
    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, class_dir in enumerate(class_dirs):
        files = sorted(p for p in class_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DataError(f"class folder {class_dir} holds no images", "add images or remove the empty folder")
        for file in files:
            try:
                with Image.open(file) as image:
                    if image.size != (width, height):
                        raise DataError(
                            f"{file} is {image.size[0]}x{image.size[1]}, the model takes {width}x{height}",
                            f"resize the images or export the model with --input-size {image.size[0]}",
                        )
                    if image.mode != "P" and (image.mode in _GREY_MODES) != (channels == 1):
                        kind = "grey" if image.mode in _GREY_MODES else "colour"
                        raise DataError(
                            f"{file} is a {kind} image, the model takes {channels}-channel images",
                            "convert the images (grey <-> colour) or export the model with matching --in-channels",
                        )
                    pixels = np.asarray(image.convert(mode), dtype=np.uint8)
            except OSError as exc:
                raise DataError(f"{file} is not a readable image ({exc})", "remove or replace the file") from None
            images.append(pixels.reshape(height, width, channels))
            labels.append(label)
    return np.stack(images), np.asarray(labels, dtype=np.int64)
