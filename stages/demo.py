"""The embedded default: a small drawn dataset, a tiny real-architecture model, and their config.

Everything is generated locally (no hub, no downloads), so ``splitflow demo`` runs on a
fresh machine.  Generation is deterministic and skipped when the files already exist.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from PIL import Image, ImageDraw

from diffsynth_core.models import get_family

from .config import RunConfig, build_config

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 70), "blue": (40, 70, 220), "yellow": (235, 210, 40),
           "purple": (140, 50, 170), "white": (245, 245, 245), "black": (20, 20, 20), "orange": (240, 140, 30)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((96, 96), (128, 96))  # (width, height): two aspect ratios, both multiples of 16
DEMO_VALIDATION_PROMPT = "a red circle on blue"  # rendered every validation_steps into output/validation/


def _draw(shape: str, fg: tuple, bg: tuple, size: tuple[int, int], rng: random.Random) -> Image.Image:
    width, height = size
    image = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(image)
    r = rng.randint(min(size) // 5, min(size) // 3)
    cx, cy = rng.randint(r, width - r), rng.randint(r, height - r)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fg)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    return image


def write_demo_dataset(folder: Path, count: int = 16, seed: int = 0) -> Path:
    """``count`` captioned images of two sizes plus ``metadata.csv``; returns the metadata path."""
    folder.mkdir(parents=True, exist_ok=True)
    metadata = folder / "metadata.csv"
    if metadata.is_file():
        return metadata
    rng = random.Random(seed)
    names = list(COLOURS)
    rows = []
    for index in range(count):
        shape = SHAPES[index % len(SHAPES)]
        fg, bg = rng.sample(names, 2)
        size = SIZES[index % len(SIZES)]
        file_name = f"{index:03d}_{fg}_{shape}.png"
        _draw(shape, COLOURS[fg], COLOURS[bg], size, rng).save(folder / file_name)
        # short enough for every tiny tokenizer (the tiny T5s of FLUX and Wan keep 32 tokens: at most 28 here)
        rows.append({"image": file_name, "prompt": f"a {fg} {shape} on {bg}"})
    tmp = metadata.with_suffix(".tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(metadata)  # the metadata appears last, so its presence means the dataset is whole
    return metadata


def write_demo_model(folder: Path, family: str = "qwen_image", seed: int = 0) -> Path:
    marker = folder / "model_index.json"
    if not marker.is_file():
        get_family(family).save_tiny_model(folder, seed)
    return folder


def demo_config(workdir: Path, family: str = "qwen_image", overrides: list[str] = ()) -> RunConfig:
    """A complete config for the demo whose outputs all live under ``workdir`` (``overrides`` last)."""
    workdir = workdir.resolve()
    data = {
        "dataset": {"base_path": str(workdir / "dataset"), "metadata_path": str(workdir / "dataset" / "metadata.csv"),
                    "repeat": 1},
        "model": {"family": family, "path": str(workdir / "model"), "dtype": "float32"},
        "cache": {"url": str(workdir / "cache.zarr"), "backend": "zarr"},
        "preprocess": {"parts": 2, "device": "cpu"},
        # Chosen so that two short epochs show learning: DiffSynth's loss weighting and uniform timesteps make one
        # sample's loss swing 0.003-2.6 from step to step, hiding the trend; timesteps drawn near the middle
        # (logit-normal, std 0.5) and unweighted losses, with a rate a tiny model can move, fall
        # by about a quarter over two epochs (docs/training.md has the schedules).
        "train": {"learning_rate": 2e-2, "num_epochs": 2, "max_steps": 32, "save_steps": 8, "lora_rank": 4, "seed": 0,
                  "device": "cpu", "timestep_sampling": "logit_normal", "logit_std": 0.5, "loss_weighting": "none",
                  "validation_inference_steps": 8},
        "output": {"path": str(workdir / "output")},
    }
    cfg = build_config(data, list(overrides), source="demo")
    spec = get_family(cfg.model.family)
    if spec.variants and cfg.model.variant is None and cfg.model.path and (
            spec.variant_of is None or spec.variant_of(Path(cfg.model.path)) is None):
        # The tiny model's files cannot tell its variant (Z-Image base and Turbo share them): it stands for the first.
        data["model"]["variant"] = next(iter(spec.variants))
    if _renders_validation(build_config(data, list(overrides), source="demo")):
        data["train"].update(validation_prompts=[DEMO_VALIDATION_PROMPT], validation_steps=16)
    return build_config(data, list(overrides), source="demo")


def _renders_validation(cfg: RunConfig) -> bool:
    """Whether the demo can render validation images: a diffusers folder and one transformer (expert runs render
    none yet, stages/train.py)."""
    from diffsynth_core.errors import InputError

    from .common import family_of

    if not cfg.model.path:
        return False
    try:
        return not family_of(cfg).experts
    except InputError:  # the files are missing or ambiguous: the run itself names it
        return True


def prepare_demo(workdir: Path, family: str = "qwen_image", overrides: list[str] = ()) -> tuple[RunConfig, Path]:
    """Write dataset, model and ``workdir/config.toml`` (unless present); return the config and its path."""
    from .demo_video import VIDEO_DEMOS, prepare_video_demo

    if family in VIDEO_DEMOS:  # drawn clips and a tiny video model (wan22: two experts)
        return prepare_video_demo(workdir, family, list(overrides))
    workdir.mkdir(parents=True, exist_ok=True)
    write_demo_dataset(workdir / "dataset")
    write_demo_model(workdir / "model", family)
    cfg = demo_config(workdir, family, overrides)
    return cfg, cfg.save(workdir / "config.toml")


def loss_trend(rows: list[dict], window: int = 6) -> str:
    """The demo's learning in one line: the mean loss of its first and last ``window`` steps."""
    losses = [float(row["loss"]) for row in rows]
    if len(losses) < 2 * window:
        return f"loss over {len(losses)} steps: " + " ".join(f"{x:.3f}" for x in losses)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    return (f"loss (mean of {window} steps) {first:.3f} at the start -> {last:.3f} at the end "
            f"of {len(losses)} steps")
