"""What is done for a config: cache completeness and training progress, read from disk only."""

from __future__ import annotations

from pathlib import Path

from cache_store import CacheFormatError, open_cache
from diffsynth_core.training.checkpoint import CheckpointManager

from .config import RunConfig


def _cache_status(cfg: RunConfig) -> dict:
    try:
        store = open_cache(cfg.cache_url, mode="r", storage_options=cfg.cache.storage_options or None)
    except (FileNotFoundError, CacheFormatError) as err:  # not written yet, or not a cache
        return {"url": cfg.cache_url, "exists": False, "expected": None, "present": 0, "complete": False,
                "note": str(err)}
    expected = store.dataset_keys()
    present = len(store.keys())
    missing = len(store.missing_keys()) if expected is not None else None
    return {"url": cfg.cache_url, "exists": True, "expected": len(expected) if expected is not None else None,
            "present": present, "missing": missing, "complete": expected is not None and missing == 0}


def _train_status(cfg: RunConfig) -> dict:
    checkpoints = CheckpointManager(cfg.output_dir / "checkpoints")
    latest = checkpoints.latest_dir()
    exports = sorted(str(p) for p in Path(cfg.output_dir).glob("*.safetensors"))
    return {"output": str(cfg.output_dir), "step": checkpoints.latest_step(), "max_steps": cfg.train.max_steps,
            "latest_checkpoint": str(latest) if latest else None, "exports": exports}


def run_status(cfg: RunConfig) -> dict:
    return {"cache": _cache_status(cfg), "train": _train_status(cfg)}
