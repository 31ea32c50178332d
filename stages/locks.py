"""The two single-writer rules of a run: one training per output folder, one writer per cache part.

Both wrap ``cache_store.locks.hold``: a second writer gets ``LockHeldError`` (exit code 3)
naming the holder's pid, host and start time; a dead holder's lock is taken over.  Re-entrant
in one process, so a flow may hold the output folder around the stages that take it again.
"""

from __future__ import annotations

import contextlib
import os

from cache_store.locks import LOCKS, hold

from .config import RunConfig
from .secrets import storage_options

OUTPUT_LOCK = ".splitflow.lock"


def output_lock(cfg: RunConfig):
    """Held for a whole training (or run) into ``output.path``; rank 0 alone holds it under torchrun."""
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    return hold(str(cfg.output_dir.resolve()), OUTPUT_LOCK, f"output folder {cfg.output_dir}")


def cache_part_lock(cfg: RunConfig, writer: str):
    """Held while preprocessing writes cache part ``writer`` (e.g. ``part-2-of-4``)."""
    return hold(cfg.cache_url, f"{LOCKS}/{writer}.lock", f"cache part {writer} of {cfg.cache_url}",
                storage_options=storage_options(cfg.cache))
