"""What is done for a config: cache completeness and training progress, read from disk only."""

from __future__ import annotations

from pathlib import Path

from cache_store import CacheFormatError, open_cache
from diffsynth_core.errors import InputError
from diffsynth_core.training.checkpoint import CheckpointManager

from .config import RunConfig
from .keys import completeness
from .secrets import storage_options


def _cache_status(cfg: RunConfig) -> dict:
    """Whether the cache holds every row *this* config trains on (derived from the config)."""
    unknown = {"url": cfg.cache_url, "expected": None, "present": 0, "complete": False}
    try:
        store = open_cache(cfg.cache_url, mode="r", storage_options=storage_options(cfg.cache))
    except (FileNotFoundError, CacheFormatError) as err:  # not written yet, or not a cache
        return {**unknown, "exists": False, "note": str(err)}
    try:
        return {"url": cfg.cache_url, "exists": True, **completeness(cfg, store)}
    except InputError as err:  # other encoders, or the config's dataset/model cannot be read
        return {**unknown, "exists": True, "note": str(err)}


def _train_status(cfg: RunConfig) -> dict:
    checkpoints = CheckpointManager(cfg.output_dir / "checkpoints")
    latest = checkpoints.latest_dir()
    exports = sorted(str(p) for p in Path(cfg.output_dir).glob("*.safetensors"))
    return {"output": str(cfg.output_dir), "step": checkpoints.latest_step(), "max_steps": cfg.train.max_steps,
            "latest_checkpoint": str(latest) if latest else None, "exports": exports}


def run_status(cfg: RunConfig) -> dict:
    return {"cache": _cache_status(cfg), "train": _train_status(cfg)}
