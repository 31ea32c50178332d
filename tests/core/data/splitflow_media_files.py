"""Helpers that write real media files (Pillow, imageio) and metadata for the dataset tests."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# Distinct, saturated colours survive JPEG/H.264 well enough to tell frames apart.
PALETTE = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 0, 255),
           (0, 255, 255), (255, 255, 255), (0, 0, 0), (128, 128, 128)]


def write_image(path: Path, width: int, height: int, color=(255, 0, 0)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), color).save(path)
    return path


def frame_arrays(n: int, width: int, height: int) -> np.ndarray:
    """n solid frames, frame i in PALETTE[i % len(PALETTE)]."""
    colors = np.array([PALETTE[i % len(PALETTE)] for i in range(n)], dtype=np.uint8)
    return np.broadcast_to(colors[:, None, None, :], (n, height, width, 3)).copy()


def write_gif(path: Path, n: int, width: int = 48, height: int = 32) -> Path:
    frames = [Image.fromarray(a) for a in frame_arrays(n, width, height)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return path


def write_mp4(path: Path, n: int, width: int = 64, height: int = 48) -> Path:
    iio = pytest.importorskip("imageio.v3")
    pytest.importorskip("imageio_ffmpeg")
    iio.imwrite(path, frame_arrays(n, width, height), fps=8, codec="libx264")
    return path


def write_metadata(path: Path, rows: list[dict]) -> Path:
    """Write rows as CSV, JSON or JSONL according to the suffix (None → empty CSV cell)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        columns = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows({k: ("" if r.get(k) is None else r[k]) for k in columns} for r in rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
