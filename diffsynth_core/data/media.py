"""Decoding media files into RGB PIL frames: still images, GIFs and videos (via imageio).

Every failure (missing, unreadable, corrupt, empty) comes out as `MediaError` with a short
reason; the dataset adds the metadata file and row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, ImageSequence

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})
GIF_EXTENSIONS = frozenset({".gif"})
VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".wmv", ".flv", ".m4v"})
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | GIF_EXTENSIONS | VIDEO_EXTENSIONS


class MediaError(ValueError):
    """A media file that cannot be used (missing, unsupported, unreadable or empty)."""


def check_media_path(path: Path) -> None:
    """Cheap checks done before decoding: the file exists and its type is known."""
    if path.suffix.lower() not in MEDIA_EXTENSIONS:
        raise MediaError(f"unsupported file type {path.suffix!r}; supported: "
                         f"{', '.join(sorted(MEDIA_EXTENSIONS))}")
    if not path.is_file():
        raise MediaError("file not found")


def is_video(path: Path) -> bool:
    return path.suffix.lower() in GIF_EXTENSIONS | VIDEO_EXTENSIONS


def read_image(path: Path) -> Image.Image:
    """Decode a still image fully (a truncated file fails here, not later) as upright RGB."""
    try:
        with Image.open(path) as image:
            image.load()
            # Phone photos store their rotation in EXIF; apply it so the pixels are upright.
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
    except FileNotFoundError as e:
        raise MediaError("file not found") from e
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise MediaError(f"cannot decode image: {_short(e)}") from e


# EXIF orientations that rotate by 90 or 270 degrees (width and height swap when applied).
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})


def read_image_size(path: Path) -> tuple[int, int] | None:
    """(height, width) of a still image as `read_image` would return it, from its header only.

    None when the header cannot be read; decoding then reports the error."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            if image.getexif().get(0x0112) in _TRANSPOSING_ORIENTATIONS:
                width, height = height, width
            return height, width
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB of any mode. 16-bit greyscale is scaled to 8 bits first: Pillow's own
    convert("RGB") clips it at 255, which turns most of such an image white."""
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        wide = np.clip(np.asarray(image).astype(np.int64), 0, 65535) >> 8
        image = Image.fromarray(wide.astype(np.uint8), "L")
    return image.convert("RGB")


def read_frames(path: Path, max_frames: int) -> list[Image.Image]:
    """Decode at most the first `max_frames` frames of a GIF or video as RGB images."""
    if path.suffix.lower() in GIF_EXTENSIONS:
        frames = _read_gif(path, max_frames)
    else:
        frames = _read_video(path, max_frames)
    if not frames:
        raise MediaError("video has no frames")
    return frames


def _read_gif(path: Path, max_frames: int) -> list[Image.Image]:
    frames = []
    try:
        with Image.open(path) as gif:
            for frame in ImageSequence.Iterator(gif):
                frames.append(frame.convert("RGB"))  # convert() copies; the iterator reuses `frame`
                if len(frames) == max_frames:
                    break
    except FileNotFoundError as e:
        raise MediaError("file not found") from e
    except (OSError, ValueError, EOFError, SyntaxError) as e:
        raise MediaError(f"cannot decode GIF: {_short(e)}") from e
    return frames


def _read_video(path: Path, max_frames: int) -> list[Image.Image]:
    import imageio.v3 as iio  # imported here so image-only users never load the video stack

    frames = []
    try:
        reader = iio.imiter(path)
        try:
            for array in reader:
                frames.append(Image.fromarray(array).convert("RGB"))
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
