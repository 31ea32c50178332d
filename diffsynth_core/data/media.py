"""Decoding media files into RGB PIL frames: still images, GIFs and videos (via imageio).

Every failure (missing, not a regular file, unreadable, corrupt, empty) comes out as
`MediaError` with a short reason; the dataset adds the metadata file and row.  Transparent
pixels are composited on a background colour (white unless told), never left as whatever
colour the file stores under them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, ImageSequence

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})
GIF_EXTENSIONS = frozenset({".gif"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".wmv", ".flv", ".m4v"})
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | GIF_EXTENSIONS | VIDEO_EXTENSIONS
WHITE = (255, 255, 255)


class MediaError(ValueError):
    """A media file that cannot be used (missing, unsupported, unreadable or empty)."""


# What a path is when it is not a regular file (stat's file types), for the error line.
_SPECIAL_FILES = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def check_media_path(path: Path) -> None:
    """Cheap checks done before decoding: the type is known and the path is a regular file.

    Never opens the path: a FIFO would block a reader forever and /dev/zero never ends."""
    if path.suffix.lower() not in MEDIA_EXTENSIONS:
        raise MediaError(f"unsupported file type {path.suffix!r}; supported: "
                         f"{', '.join(sorted(MEDIA_EXTENSIONS))}")
    link = f" (symlink to {os.readlink(path)})" if path.is_symlink() else ""
    try:
        mode = path.stat().st_mode  # follows symlinks
    except FileNotFoundError:
        raise MediaError(f"file not found{link}") from None
    except OSError as e:  # a symlink loop, a path through a file, permissions
        raise MediaError(f"cannot read{link}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise MediaError(f"is a folder{link}, not a media file")
    for is_kind, kind in _SPECIAL_FILES:
        if is_kind(mode):
            raise MediaError(f"is {kind}{link}, not a regular file")


def frame_count_of_gif(path: Path) -> int:
    """Frames in a GIF, from its headers (0 when it cannot be read: decoding reports why)."""
    try:
        with Image.open(path) as gif:
            return getattr(gif, "n_frames", 1)
    except (OSError, ValueError, EOFError, SyntaxError):
        return 0


def is_video(path: Path) -> bool:
    return path.suffix.lower() in GIF_EXTENSIONS | VIDEO_EXTENSIONS


def read_image(path: Path, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """Decode a still image fully (a truncated file fails here, not later) as upright RGB."""
    try:
        with Image.open(path) as image:
            frames = getattr(image, "n_frames", 1)
            if frames > 1:  # an animated WebP or PNG would train on its first frame alone
                raise MediaError(f"is animated ({frames} frames), and a still image is read here: give one "
                                 "frame as its own file, or (video families) the clip as .gif or .mp4 in the "
                                 "video column")
            image.load()
            # Phone photos store their rotation in EXIF; apply it so the pixels are upright.
            image = ImageOps.exif_transpose(_narrowed(image))
            return to_rgb(image, background)
    except FileNotFoundError as e:
        raise MediaError("file not found") from e
    except MediaError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise MediaError(f"cannot decode image: {_short(e)}") from e


# EXIF orientations that rotate by 90 or 270 degrees (width and height swap when applied).
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})


def read_image_header(path: Path) -> tuple[int, int, bool] | None:
    """(height, width, has alpha) of a still image as `read_image` would see it, from its header only.

    None when the header cannot be read; decoding then reports the error."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            if image.getexif().get(0x0112) in _TRANSPOSING_ORIENTATIONS:
                width, height = height, width
            return height, width, has_alpha(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None


def over_white(image: Image.Image) -> Image.Image:
    """An RGBA image's colour composited over white as Qwen-Image-2.1's pipelines do it (``paste`` with the
    alpha as mask: diffusers' pipeline_qwenimage21.py, DiffSynth's composite_over_white); RGB as it is."""
    if image.mode != "RGBA":
        return image
    canvas = Image.new("RGB", image.size, WHITE)
    canvas.paste(image, mask=image.getchannel("A"))
    return canvas


def has_alpha(image: Image.Image) -> bool:
    """An alpha channel, or a palette/colour key marking some pixels transparent."""
    return image.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in image.info


def to_rgb(image: Image.Image, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """RGB of any mode, transparent pixels composited on ``background``.

    Pillow's convert("RGB") drops alpha and keeps the colour stored under it (often black or
    garbage).  16- and 32-bit greyscale and float images are scaled to 8 bits first: convert("RGB")
    clips them at 255 (a 16-bit image turns mostly white) or truncates floats in [0, 1] to 0 (black)."""
    if image.mode in _WIDE_MODES:
        image = Image.fromarray(_to_8_bits(image), "L")
    if has_alpha(image):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*background, 255)), rgba).convert("RGB")
    return image.convert("RGB")


_WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")
_TIFF_BITS_PER_SAMPLE, _TIFF_SAMPLE_FORMAT, _TIFF_UNSIGNED = 258, 339, 1


def _narrowed(image: Image.Image) -> Image.Image:
    """A wide greyscale image as 8 bits while its file's tags (bit depth) are still at hand; EXIF kept."""
    if image.mode not in _WIDE_MODES:
        return image
    narrow = Image.fromarray(_to_8_bits(image), "L")
    narrow.info["exif"] = image.getexif().tobytes()
    return narrow


def _to_8_bits(image: Image.Image) -> np.ndarray:
    """One wide greyscale channel (16/32-bit integers, 32-bit floats) as 8 bits over its type's range."""
    values = np.asarray(image)
    if image.mode == "F":
        if not np.isfinite(values).all() or values.min() < 0 or values.max() > 255:
            raise MediaError(f"is a float image with values from {values.min():g} to {values.max():g}: only 0-1 "
                             "or 0-255 can be read as brightness; save it as an 8- or 16-bit image")
        scale = 255.0 if values.max() <= 1.0 else 1.0  # floats in [0, 1] are the usual convention
        return np.clip(np.rint(values * scale), 0, 255).astype(np.uint8)
    tags = getattr(image, "tag_v2", {})
    bits = tags.get(_TIFF_BITS_PER_SAMPLE, (16,))
    bits = bits[0] if isinstance(bits, tuple) else bits
    if image.mode == "I" and bits == 32:  # a 32-bit TIFF; mode "I" from any other file holds 16 bits
        fmt = tags.get(_TIFF_SAMPLE_FORMAT, (_TIFF_UNSIGNED,))
        if (fmt[0] if isinstance(fmt, tuple) else fmt) == _TIFF_UNSIGNED:
            return (values.astype(np.int32).view(np.uint32) >> 24).astype(np.uint8)
        return (np.clip(values.astype(np.int64), 0, 2**31 - 1) >> 23).astype(np.uint8)
    return (np.clip(values.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)


def read_frames(path: Path, max_frames: int, background: tuple[int, int, int] = WHITE) -> list[Image.Image]:
    """Decode at most the first `max_frames` frames of a GIF or video as RGB images."""
    if path.suffix.lower() in GIF_EXTENSIONS:
        frames = _read_gif(path, max_frames, background)
    else:
        frames = _read_video(path, max_frames, background)
    if not frames:
        raise MediaError("video has no frames")
    return frames


def _read_gif(path: Path, max_frames: int, background: tuple[int, int, int]) -> list[Image.Image]:
    frames = []
    try:
        with Image.open(path) as gif:
            for frame in ImageSequence.Iterator(gif):
                frames.append(to_rgb(frame, background))  # converting copies; the iterator reuses `frame`
                if len(frames) == max_frames:
                    break
    except FileNotFoundError as e:
        raise MediaError("file not found") from e
    except (OSError, ValueError, EOFError, SyntaxError) as e:
        raise MediaError(f"cannot decode GIF: {_short(e)}") from e
    return frames


def _read_video(path: Path, max_frames: int, background: tuple[int, int, int]) -> list[Image.Image]:
    import imageio.v3 as iio  # imported here so image-only users never load the video stack

    frames = []
    try:
        reader = iio.imiter(path)
        try:
            for array in reader:
                frames.append(to_rgb(Image.fromarray(array), background))  # RGBA codecs exist
                if len(frames) == max_frames:
                    break
        finally:
            reader.close()  # stops the ffmpeg subprocess when we break early
    except FileNotFoundError as e:
        raise MediaError("file not found") from e
    except (OSError, ValueError, RuntimeError, IndexError) as e:
        # imageio raises these for corrupt files, missing codecs or a missing imageio-ffmpeg.
        raise MediaError(f"cannot decode video: {_short(e)}") from e
    return frames


def _short(error: Exception) -> str:
    """First line of an error (ffmpeg appends its whole log), plus its last line if different."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    if not lines:
        return type(error).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"


def usable_frame_count(available: int, frame_multiple: int = 1) -> int:
    """Largest n <= available with n ≡ 1 (mod frame_multiple): 4k+1 frames for Wan's VAE.

    frame_multiple=1 keeps every available frame. `available` is already capped at
    num_frames by the reader.
    """
    if available < 1:
        raise MediaError("video has no frames")
    if frame_multiple <= 1:
        return available
    return (available - 1) // frame_multiple * frame_multiple + 1
