"""Crop-and-resize size rules and the centre crop, on real PIL images."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from diffsynth_core.data import crop_and_resize, crop_and_resize_size
from diffsynth_core.data.resize import TooSmallError


def test_small_image_is_never_upscaled_only_floored_to_division():
    assert crop_and_resize_size(60, 100, max_pixels=1024 * 1024) == (48, 96)
    assert crop_and_resize_size(64, 64, max_pixels=1024 * 1024) == (64, 64)


def test_large_image_shrinks_under_max_pixels_keeping_aspect():
    h, w = crop_and_resize_size(1000, 2000, max_pixels=512 * 512)
    # sqrt(262144 / 2e6) = 0.36204 → 362 x 724 → floored to multiples of 16.
    assert (h, w) == (352, 720)
    assert h * w <= 512 * 512 and h % 16 == 0 and w % 16 == 0
    assert math.isclose(w / h, 2.0, rel_tol=0.05)


def test_division_is_respected():
    assert crop_and_resize_size(100, 100, division=32) == (96, 96)
    assert crop_and_resize_size(100, 100, division=8) == (96, 96)
    assert crop_and_resize_size(60, 60, division=8) == (56, 56)


def test_fixed_size_is_returned_as_is_and_ignores_max_pixels():
    assert crop_and_resize_size(10, 20, height=512, width=256, max_pixels=64) == (512, 256)


def test_side_below_division_after_resize_is_too_small():
    with pytest.raises(TooSmallError, match="division=16"):
        crop_and_resize_size(10, 200)
    # Long thin images: fine at full size, but max_pixels shrinks the short side below 16.
    with pytest.raises(TooSmallError, match="max_pixels=4096"):
        crop_and_resize_size(20, 4000, max_pixels=4096)


def _stripes(width: int, height: int) -> Image.Image:
    """Left quarter red, middle half green, right quarter blue."""
    a = np.zeros((height, width, 3), dtype=np.uint8)
    a[:, : width // 4] = (255, 0, 0)
    a[:, width // 4: 3 * width // 4] = (0, 255, 0)
    a[:, 3 * width // 4:] = (0, 0, 255)
    return Image.fromarray(a)


def test_centre_crop_keeps_the_middle():
    out = crop_and_resize(_stripes(64, 32), 32, 32)
    assert out.size == (32, 32)
    assert (np.asarray(out) == (0, 255, 0)).all()


def test_resize_covers_target_by_the_larger_scale_then_crops():
    # 128x32 → 64x64 needs scale max(0.5, 2) = 2 → 256x64, centre crop 64 wide: all green.
    out = crop_and_resize(_stripes(128, 32), 64, 64)
    assert out.size == (64, 64)
    assert (np.asarray(out)[:, 2:-2] == (0, 255, 0)).all()


def test_same_size_is_untouched():
    image = _stripes(32, 16)
    assert crop_and_resize(image, 16, 32) is image
