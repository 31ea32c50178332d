"""Crop-and-resize rules: which size a picture becomes, and how it gets there.

Dynamic size (no fixed height/width): shrink to at most `max_pixels` keeping the aspect
ratio (never upscale), then floor each side to a multiple of `division`.
Fixed size: exactly `height` x `width`.
Either way the picture is resized by the larger of the two scale factors (so it covers the
target) and centre-cropped, as DiffSynth-Studio's `ImageCropAndResize` does.
"""

from __future__ import annotations

import math

from PIL import Image


class TooSmallError(ValueError):
    """A side would be smaller than `division` after resizing (no latent fits)."""


def crop_and_resize_size(src_height: int, src_width: int, *, height: int | None = None,
                         width: int | None = None, max_pixels: int = 1024 * 1024,
                         division: int = 16) -> tuple[int, int]:
    """Return the (height, width) a src_height x src_width picture is cropped and resized to."""
    if height is not None and width is not None:
        return height, width
    h, w = src_height, src_width
    if h * w > max_pixels:
        scale = math.sqrt(max_pixels / (h * w))
        # int() truncates, so h*w stays <= max_pixels.
        h, w = int(h * scale), int(w * scale)
    h, w = h // division * division, w // division * division
    if h < division or w < division:
        raise TooSmallError(
            f"{src_width}x{src_height} (WxH) is too small: a side becomes < division={division} "
            f"after resizing to at most max_pixels={max_pixels} and flooring to multiples of "
            f"{division}")
    return h, w


def crop_and_resize(image: Image.Image, height: int, width: int) -> Image.Image:
    """Resize `image` to cover height x width (bilinear, like the reference), then centre-crop."""
    src_w, src_h = image.size
    if (src_h, src_w) == (height, width):
        return image
    scale = max(width / src_w, height / src_h)
    new_w = max(width, round(src_w * scale))
    new_h = max(height, round(src_h * scale))
    image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    # Same rounding as torchvision's center_crop, so crops match the reference pixel for pixel.
    top = int(round((new_h - height) / 2.0))
    left = int(round((new_w - width) / 2.0))
    return image.crop((left, top, left + width, top + height))
