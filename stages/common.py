"""Small helpers both stages share: device choice, dataset and model identity from a config."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from cache_store.digests import file_digest
from diffsynth_core.data import SampleDataset
from diffsynth_core.models import FamilySpec

from .config import RunConfig
from diffsynth_core.errors import InputError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name!r} asked for, but this machine has no CUDA device")
    return device


def init_distributed(device: torch.device) -> torch.device:
    """Join the process group a launcher (torchrun) describes in the environment, if any.

    Returns the device this rank computes on: ``cuda:LOCAL_RANK`` for CUDA runs (NCCL),
    the given device otherwise (gloo).  A single process is left untouched.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def model_dtype(cfg: RunConfig) -> torch.dtype:
    return getattr(torch, cfg.model.dtype)


def open_dataset(cfg: RunConfig, spec: FamilySpec) -> SampleDataset:
    section = cfg.dataset
    if not section.metadata_path:
        raise InputError("dataset.metadata_path is empty: point it at a metadata.csv/.json/.jsonl file")
    return SampleDataset(
        section.metadata_path, section.base_path or None,
        data_file_keys=tuple(section.data_file_keys), height=section.height, width=section.width,
        max_pixels=section.max_pixels, num_frames=section.num_frames, frame_multiple=spec.frame_multiple,
        repeat=section.repeat, skip_bad_samples=section.skip_bad_samples,
    )


def component_files(cfg: RunConfig, spec: FamilySpec, name: str) -> list[Path]:
    """The files component ``name`` is loaded from, in a stable order (what identifies it).

    Today a component is a subfolder of ``model.path`` in the diffusers layout; other layouts
    (released single files) plug in here, so identity and loading always agree on the files.
    """
    root = Path(cfg.model.path)
    if not root.is_dir():
        raise InputError(f"model.path {root} is not a directory (expected a diffusers-layout model folder)")
    folder = root / name
    if not folder.is_dir():
        raise InputError(f"model folder {root} has no {name}/ component, which family {spec.name} needs")
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _file_label(path: Path, folder: Path) -> str:
    """A file's name within its component (relative path in a folder, else the file name)."""
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return path.name


def component_digests(cfg: RunConfig, spec: FamilySpec, name: str) -> dict[str, str]:
    """sha256 of every file component ``name`` loads from, by name within the component."""
    folder = Path(cfg.model.path) / name
    return {_file_label(path, folder): file_digest(path) for path in component_files(cfg, spec, name)}


def encoder_identity(cfg: RunConfig, spec: FamilySpec) -> dict:
    """What identifies the encoders: the family, and the content of every file they load from.

    Digests are remembered per file (path, size, mtime, inode) across runs, so only the first
    run on a machine reads the weights in full; a same-size edit still changes the identity.
    """
    components = {name: component_digests(cfg, spec, name) for name in spec.encoder_components}
    return {"family": spec.name, "components": components}
