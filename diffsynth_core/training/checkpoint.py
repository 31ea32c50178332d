"""Atomic, resumable training checkpoints.

Layout under ``<output>/checkpoints``::

    step-00000010/
        trainable.safetensors   trainable weights by parameter name (+ LoRA config in metadata)
        optimizer.pt            optimizer and LR-scheduler state
        state.pt                step, epoch, sampler position, every RNG state
    latest                      text file naming the newest complete step directory
    orphaned/step-00000020-20250101-120000/   step folders found newer than ``latest``

A checkpoint is written into a temporary directory and renamed into place; ``latest`` is
replaced (temp file + rename) only afterwards, so a kill at any moment leaves either the old
or the new checkpoint, never a torn one.  Only the last ``keep`` checkpoints are kept.

A step folder newer than ``latest`` (a crash between the rename and the pointer, or a folder a
user put there) is never deleted or overwritten: the next save moves it aside to ``orphaned/``.
A write that fails (full disk, read-only folder) removes its temporary folder and leaves
``latest`` and every earlier checkpoint as they were.  Non-finite weights are never written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import EnvironmentFailure, InputError, classify
from .guards import require_finite

LATEST = "latest"
ORPHANED = "orphaned"

log = logging.getLogger(__name__)


def _step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.split("-")[1])
    except (IndexError, ValueError):
        return None


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save through a Python file, so a full disk raises OSError(ENOSPC) naming the file
    (torch.save(obj, path) reports only "unexpected pos N vs M")."""
    try:
        with path.open("wb") as handle:
            torch.save(obj, handle)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from err


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_state(path: Path) -> Any:
    """A checkpoint's torch state (tensors, numbers, RNG states only): pickled code is refused, as input."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as err:
        detail = " ".join(str(err).split())[:160]
        raise InputError(f"checkpoint file {path} cannot be loaded safely ({type(err).__name__}: {detail}); it holds "
                         "more than a checkpoint does (pickled code?) or is damaged: move that step folder out of "
                         f"{path.parent.parent} to resume from an earlier checkpoint, or set output.path to start "
                         "anew") from None


class CheckpointManager:
    def __init__(self, root: Path | str, keep: int = 3):
        self.root = Path(root)
        self.keep = keep

    # -- public verbs --------------------------------------------------------------------------
    def save(self, step: int, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
             state: dict[str, Any], metadata: dict[str, Any] | None = None) -> Path:
        final = self.root / _step_dir_name(step)
        weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        require_finite(weights, f"checkpoint {final}")
        self.root.mkdir(parents=True, exist_ok=True)
        # Folders past `latest` (a crash between rename and pointer, or a user's) and any at this step.
        self._set_aside_newer_than(min(self.latest_step(), step - 1))
        tmp = self.root / f".tmp-{_step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            text_meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
            save_file(weights, str(tmp / "trainable.safetensors"), metadata=text_meta)
            _torch_save(optimizer_state, tmp / "optimizer.pt")
            _torch_save(state, tmp / "state.pt")
            _fsync_dir(tmp)
        except Exception as err:
            shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint and `latest` stay as they were
            found = classify(err)
            if isinstance(found, EnvironmentFailure):
                raise EnvironmentFailure(f"writing checkpoint {final} failed, earlier checkpoints are intact: "
                                         f"{found}", retryable=found.retryable) from err
            raise
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
        return {"path": path, "weights": weights, "optimizer": _load_state(path / "optimizer.pt"),
                "state": _load_state(path / "state.pt"), "metadata": metadata}

    # -- internals -----------------------------------------------------------------------------
    def _set_aside_newer_than(self, step: int) -> None:
        """Move step folders past ``latest`` to ``orphaned/`` (never delete what someone may want)."""
        for path in sorted(self.root.glob("step-*")):
            if not path.is_dir() or _step_of(path) is None or _step_of(path) <= step:
                continue
            target = self.root / ORPHANED / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            if target.exists():
                target = target.with_name(f"{target.name}-{uuid.uuid4().hex[:6]}")
            target.parent.mkdir(exist_ok=True)
            path.rename(target)
            log.warning("checkpoint %s is newer than %s (step %d): moved aside to %s", path.name, LATEST, step, target)

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
