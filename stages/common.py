"""Small helpers both stages share: device choice, dataset and model identity from a config."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from diffsynth_core.data import SampleDataset
from diffsynth_core.models import FamilySpec

from .config import RunConfig


def resolve_device(name: str) -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but this machine has no CUDA device")
    return device


def model_dtype(cfg: RunConfig) -> torch.dtype:
    return getattr(torch, cfg.model.dtype)


def open_dataset(cfg: RunConfig, spec: FamilySpec) -> SampleDataset:
    section = cfg.dataset
    if not section.metadata_path:
        raise ValueError("dataset.metadata_path is empty: point it at a metadata.csv/.json/.jsonl file")
    return SampleDataset(
        section.metadata_path, section.base_path or None,
        data_file_keys=tuple(section.data_file_keys), height=section.height, width=section.width,
        max_pixels=section.max_pixels, num_frames=section.num_frames, frame_multiple=spec.frame_multiple,
        repeat=section.repeat, skip_bad_samples=section.skip_bad_samples,
    )


def encoder_identity(cfg: RunConfig, spec: FamilySpec) -> dict:
    """What identifies the encoders: family, and each component's file names, sizes and configs.

    Weights are identified by name and size (hashing 40 GB of weights per run would cost
    minutes); their config files are hashed in full.
    """
    root = Path(cfg.model.path)
    if not root.is_dir():
        raise FileNotFoundError(f"model.path {root} is not a directory (expected a diffusers-layout model folder)")
    components = {}
    for name in spec.encoder_components:
        folder = root / name
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder {root} has no {name}/ component, which family {spec.name} needs")
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = str(path.relative_to(folder))
            if path.suffix in (".json", ".txt", ".model"):
                files[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                files[rel] = path.stat().st_size
        components[name] = files
    return {"family": spec.name, "components": components}
