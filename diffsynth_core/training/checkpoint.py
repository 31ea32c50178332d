"""Atomic, resumable training checkpoints.

Layout under ``<output>/checkpoints``::

    step-00000010/
        trainable.safetensors   trainable weights by parameter name (+ LoRA config in metadata)
        optimizer.pt            optimizer and LR-scheduler state
        state.pt                step, epoch, sampler position, every RNG state
    latest                      text file naming the newest complete step directory

A checkpoint is written into a temporary directory and renamed into place; ``latest`` is
replaced (temp file + rename) only afterwards, so a kill at any moment leaves either the old
or the new checkpoint, never a torn one.  Only the last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from ..errors import InputError

LATEST = "latest"


def _step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    def __init__(self, root: Path | str, keep: int = 3):
        self.root = Path(root)
        self.keep = keep

    # -- public verbs --------------------------------------------------------------------------
    def save(self, step: int, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
             state: dict[str, Any], metadata: dict[str, Any] | None = None) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / _step_dir_name(step)
        tmp = self.root / f".tmp-{_step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        text_meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                  str(tmp / "trainable.safetensors"), metadata=text_meta)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(state, tmp / "state.pt")
        _fsync_dir(tmp)
        if final.exists():  # a re-run of the same step after a crash past the rename
            shutil.rmtree(final)
        tmp.rename(final)
        self._point_latest_to(final.name)
        self._prune()
        return final

    def latest_step(self) -> int:
        """The step of the newest complete checkpoint, 0 when there is none."""
        path = self.latest_dir()
        return int(path.name.split("-")[1]) if path is not None else 0

    def latest_dir(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "state.pt").is_file():
            raise InputError(f"checkpoint pointer {pointer} names {path}, which is incomplete")
        return path

    def latest_metadata(self) -> dict[str, Any] | None:
        """The metadata saved with the newest complete checkpoint (no tensor is read), or None."""
        path = self.latest_dir()
        if path is None:
            return None
        with safe_open(str(path / "trainable.safetensors"), framework="pt") as handle:
            return {k: json.loads(v) for k, v in (handle.metadata() or {}).items()}

    def load(self) -> dict[str, Any] | None:
        """The newest complete checkpoint as {weights, optimizer, state, metadata}, or None."""
        path = self.latest_dir()
        if path is None:
            return None
        with safe_open(str(path / "trainable.safetensors"), framework="pt") as handle:
            weights = {name: handle.get_tensor(name) for name in handle.keys()}
            metadata = {k: json.loads(v) for k, v in (handle.metadata() or {}).items()}
        return {
            "path": path,
            "weights": weights,
            "optimizer": torch.load(path / "optimizer.pt", weights_only=True),
            "state": torch.load(path / "state.pt", weights_only=True),
            "metadata": metadata,
        }

    # -- internals -----------------------------------------------------------------------------
    def _point_latest_to(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(name + "\n")
        tmp.replace(self.root / LATEST)
        _fsync_dir(self.root)

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step-*"):  # left by a killed writer
            shutil.rmtree(stale, ignore_errors=True)
