"""Images: uint8 pixels (or floats in [0, 1]) of an image folder or an .npz, normalised per channel.

Pixel convention: uint8 pixels are divided by 255; float pixels are taken as already scaled to [0, 1] (values
outside it are refused). Both are then normalised with the manifest's per-channel mean and std. Arrays may be NCHW
or NHWC, told apart by the model's input shape; a device holds 1 byte per pixel (normalised a batch at a time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgepfl.errors import DataError
from edgepfl.kinds.base import DeviceSamples, InputSpec, KindWords, SampleKind, read_npz, standardized
from edgepfl.kinds.pictures import IMAGE_SUFFIXES, read_image, read_image_folder

# float pixels may come from JPEG decoding or resampling that overshoots [0, 1] by a rounding error
_FLOAT_PIXEL_SLACK = 1e-3


@dataclass(frozen=True, kw_only=True)
class ImageKind(SampleKind):
    """An image classifier's samples: (C, H, W) images."""

    name: ClassVar[str] = "image"
    words: ClassVar[KindWords] = KindWords("image", "images", "an .npz file or an image folder")
    described: ClassVar[str] = "images"

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], input_spec: InputSpec, num_classes: int) -> ImageKind:
        """An image model's kind (its entry says nothing more than its name)."""
        return cls(input=input_spec)

    def check_inputs(self, x: np.ndarray, what: str = "x") -> np.ndarray:
        """Images as (N, C, H, W) (NHWC transposed, grey (N, H, W) given its channel), uint8 or floats in [0, 1]."""
        images = _nchw(np.asarray(x), self.input.shape, what)
        check_pixels(images, what)
        return images

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """float32 NCHW: uint8 / 255 (floats taken as [0, 1]), then (x - mean) / std per channel."""
        images = _nchw(x, self.input.shape, "x")
        return standardized(images, self.input, 1.0 / 255.0 if images.dtype == np.uint8 else None)

    def read(self, path: Path, bundle: Path, class_labels: Sequence[str]) -> DeviceSamples:
        """An image folder (a folder per class) or an .npz of `x` images and `y` labels."""
        if path.is_dir():
            return DeviceSamples(*read_image_folder(path, self.input.shape, class_labels))
        if path.is_file():
            return DeviceSamples(*read_npz(path))
        raise DataError(f"data path {path} does not exist", "pass an .npz file or an image folder")

    def input_files(self, path: Path) -> list[Path]:
        """An image file, or a folder's images (hidden entries skipped, in path order)."""
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if _is_image(p, path))
            if not files:
                raise DataError(f"folder {path} holds no images", f"add {', '.join(IMAGE_SUFFIXES)} files to it")
            return files
        if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
            return [path]
        if path.is_file():
            raise DataError(
                f"{path} is neither an image ({', '.join(IMAGE_SUFFIXES)}) nor an .npz",
                "pass image files, folders of images or .npz files with images as x",
            )
        raise DataError(f"{path} does not exist", "pass image files, folders of images or .npz files")

    def read_input_file(self, path: Path) -> np.ndarray:
        """One image file as a (1, C, H, W) uint8 batch, converted and resized as training images are."""
        return read_image(path, self.input.shape).transpose(2, 0, 1)[None]


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


def _nchw(x: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Images as (N, C, H, W), without copying when they already are; DataError when they cannot fit."""
    channels, height, width = shape
    if x.ndim == 3 and channels == 1 and x.shape[1:] == (height, width):
        return x[:, None, :, :]
    if x.ndim == 4:
        nchw = x.shape[1:] == (channels, height, width)
        nhwc = x.shape[1:] == (height, width, channels)
        if nchw:  # an image both ways (H = C, W = H) is taken as the model's NCHW
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


def _is_image(path: Path, folder: Path) -> bool:
    """An image file inside `folder`, not hidden and not inside a hidden folder."""
    inside = path.relative_to(folder).parts
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file() and not any(p.startswith(".") for p in inside)
