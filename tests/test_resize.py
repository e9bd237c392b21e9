"""The device loader's resize: one numpy algorithm the browser device repeats bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.errors import DataError
from edgepfl.kinds.pictures import read_image_folder, resize_image


def test_same_size_is_untouched_and_constant_stays_constant():
    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    assert resize_image(pixels, 6, 5) is pixels
    flat = np.full((37, 45, 1), 201, dtype=np.uint8)
    assert np.array_equal(resize_image(flat, 8, 8), np.full((8, 8, 1), 201, dtype=np.uint8))


def test_upscale_is_bilinear_with_pixel_centres():
    row = np.array([[[0], [100]]], dtype=np.uint8)
    assert resize_image(row, 1, 4).ravel().tolist() == [0, 25, 75, 100]


def test_shrinking_averages_every_source_pixel():
    # a 2x shrink weighs each output's four nearest source pixels 1:3:3:1 (the widened triangle);
    # at the border the taps that fall outside are dropped and the rest renormalised (3:3:1 -> 80/7)
    row = np.array([[[0], [0], [80], [0], [0], [0]]], dtype=np.uint8)
    assert resize_image(row, 1, 3).ravel().tolist() == [11, 30, 0]


@pytest.mark.parametrize("source, target", [((37, 45), (32, 32)), ((9, 11), (32, 32)), ((300, 400), (16, 16))])
def test_close_to_pillow_bilinear(source, target):
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 256, (*source, 3), dtype=np.uint8)
    ours = resize_image(pixels, *target).astype(int)
    pillow = np.asarray(Image.fromarray(pixels).resize(target[::-1], Image.BILINEAR)).astype(int)
    assert ours.shape == (*target, 3)
    assert np.abs(ours - pillow).max() <= 1  # Pillow rounds to uint8 between its two passes; we do not


def test_image_folder_resizes_to_the_model_input(tmp_path):
    from PIL import Image

    pixels = np.random.default_rng(2).integers(0, 256, (13, 21, 3), dtype=np.uint8)
    (tmp_path / "1").mkdir()
    Image.fromarray(pixels).save(tmp_path / "1" / "a.png")
    images, labels = read_image_folder(tmp_path, (3, 8, 8), ("0", "1"))
    assert images.shape == (1, 8, 8, 3) and labels.tolist() == [1]
    assert np.array_equal(images[0], resize_image(pixels, 8, 8))


def test_resize_refuses_non_pixels():
    with pytest.raises(DataError, match="cannot resize pixels of dtype float32"):
        resize_image(np.zeros((4, 4, 3), dtype=np.float32), 2, 2)
