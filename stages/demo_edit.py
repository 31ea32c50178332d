"""The edit demo's drawn dataset: (reference, instruction, target) triples.

Each reference is one of the demo's shapes in one colour; its target is the same shape at the same
place in another colour, and the instruction says which ("make the circle blue").  The metadata
is DiffSynth-Studio's edit layout (``image``, ``prompt``, ``edit_image``; a JSON list in the
``edit_image`` cell for the multi-reference models, as its Qwen-Image-Edit-2509 example dataset
keeps it), so the demo exercises the reference path users bring.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from .demo import COLOURS, SHAPES, SIZES, _draw


def write_edit_dataset(folder: Path, count: int = 8, seed: int = 0, as_list: bool = True,
                       name: str = "metadata.csv") -> Path:
    """``count`` triples plus their metadata ``name`` (.csv, or .json as DiffSynth's 2509/2511 examples;
    ``as_list``: ``edit_image`` a list, else a file name as Edit v1's dataset has it); returns the
    metadata path.  Skipped when it exists."""
    folder.mkdir(parents=True, exist_ok=True)
    metadata = folder / name
    if metadata.is_file():
        return metadata
    rng = random.Random(seed)
    names = list(COLOURS)
    rows = []
    for index in range(count):
        shape = SHAPES[index % len(SHAPES)]
        before, after, background = rng.sample(names, 3)
        size = SIZES[index % len(SIZES)]
        geometry = rng.random()  # the same place and size in both images
        reference, target = f"{index:03d}_ref.png", f"{index:03d}_target.png"
        _draw(shape, COLOURS[before], COLOURS[background], size, random.Random(geometry)).save(folder / reference)
        _draw(shape, COLOURS[after], COLOURS[background], size, random.Random(geometry)).save(folder / target)
        rows.append({"image": target, "prompt": f"make the {shape} {after}",
                     "edit_image": [reference] if as_list else reference})
    tmp = metadata.with_suffix(".tmp")
    if metadata.suffix == ".json":
        tmp.write_text(json.dumps(rows, indent=1))
    else:  # a list is a JSON list inside the CSV cell
        with tmp.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["image", "prompt", "edit_image"])
            writer.writeheader()
            writer.writerows({**r, "edit_image": json.dumps(r["edit_image"]) if as_list else r["edit_image"]}
                             for r in rows)
    tmp.replace(metadata)  # the metadata appears last, so its presence means the dataset is whole
    return metadata


def prepare_edit_demo(workdir: Path, variant: str = "edit-2509", overrides: list[str] = ()):
    """The edit demo: the drawn triples, a tiny ``variant`` model and ``workdir/config.toml`` (the
    demo's config with the variant; references at about the targets' size, so it runs on a CPU)."""
    from diffsynth_core.models import get_family

    from .demo import demo_config

    workdir.mkdir(parents=True, exist_ok=True)
    write_edit_dataset(workdir / "dataset", count=6, as_list=variant != "edit")
    if not (workdir / "model" / "model_index.json").is_file():
        get_family("qwen_image", variant).save_tiny_model(workdir / "model", 0)
    settings = [f"model.variant={variant}", "dataset.reference_pixels=12288", "train.learning_rate=1e-2"]
    cfg = demo_config(workdir, "qwen_image", settings + list(overrides))
    return cfg, cfg.save(workdir / "config.toml")
