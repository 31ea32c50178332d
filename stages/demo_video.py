"""A drawn few-frame video dataset (a shape moving across a plain background), for video demos.

GIF clips (Pillow writes them; the dataset reads them as videos), deterministic and generated
locally like the image demo (``stages.demo``).  Sizes are multiples of 32, so every Wan VAE
(8x or 16x, patch 2) takes them as they are.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from PIL import Image, ImageDraw

from .demo import COLOURS, SHAPES

VIDEO_SIZE = (64, 64)  # (width, height)
VIDEO_FRAMES = 5       # 4k+1: the Wan VAEs' frame rule


def _frame(shape: str, fg: tuple, bg: tuple, centre: tuple[int, int], r: int) -> Image.Image:
    image = Image.new("RGB", VIDEO_SIZE, bg)
    draw = ImageDraw.Draw(image)
    cx, cy = centre
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fg)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    return image


def write_demo_video_dataset(folder: Path, count: int = 6, seed: int = 0) -> Path:
    """``count`` captioned clips of ``VIDEO_FRAMES`` frames plus ``metadata.csv`` (``video,prompt``)."""
    folder.mkdir(parents=True, exist_ok=True)
    metadata = folder / "metadata.csv"
    if metadata.is_file():
        return metadata
    rng, names, rows = random.Random(seed), list(COLOURS), []
    width, height = VIDEO_SIZE
    for index in range(count):
        shape = SHAPES[index % len(SHAPES)]
        fg, bg = rng.sample(names, 2)
        r = rng.randint(8, 14)
        y, step = rng.randint(r, height - r), (width - 2 * r) // (VIDEO_FRAMES - 1)
        frames = [_frame(shape, COLOURS[fg], COLOURS[bg], (r + i * step, y), r) for i in range(VIDEO_FRAMES)]
        file_name = f"{index:03d}_{fg}_{shape}.gif"
        frames[0].save(folder / file_name, save_all=True, append_images=frames[1:], duration=100, loop=0)
        rows.append({"video": file_name, "prompt": f"a {fg} {shape} moving right on a {bg} background"})
    tmp = metadata.with_suffix(".tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["video", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(metadata)  # last: its presence means the dataset is whole
    return metadata


# ``splitflow demo --family NAME`` for the video demos: (model family, its variant).
VIDEO_DEMOS = {"wan22": ("wan", "t2v-a14b"), "wan22-ti2v": ("wan", "ti2v-5b")}


def prepare_video_demo(workdir: Path, name: str, overrides: list[str] = ()):
    """The drawn clips, the tiny model of demo ``name`` and ``workdir/config.toml`` (unless present)."""
    from diffsynth_core.models import get_family

    from .demo import demo_config

    family, variant = VIDEO_DEMOS[name]
    workdir.mkdir(parents=True, exist_ok=True)
    write_demo_video_dataset(workdir / "dataset")
    if not (workdir / "model" / "model_index.json").is_file():
        get_family(family, variant).save_tiny_model(workdir / "model", 0)
    cfg = demo_config(workdir, family, [f"dataset.num_frames={VIDEO_FRAMES}", "train.max_steps=8",
                                        "train.save_steps=4", *overrides])
    return cfg, cfg.save(workdir / "config.toml")
