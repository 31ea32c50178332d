"""Python's cyclic garbage collector, kept off the training step.

A full (generation-2) collection walks every object the process holds.  With torch, diffusers and
a model loaded that is ~0.4 M objects and 0.1-0.25 s, during which no kernel is launched: on the H200
it showed as a 248 ms hole in an all-resident Qwen-Image step, and steps that wandered from 0.93 to
1.6 s once the collector's thresholds were reached.  Freezing what exists when the steps begin moves
it out of the collector's sight (reference counting still frees it); what the steps allocate is
still collected, in passes over those objects only.  torchtitan meets the same pauses by switching
the collector off (torchtitan/tools/utils.py, ``GarbageCollection``); freezing keeps cycles that the
steps make collectable.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, then hide every object alive now from the collector until the block ends.

    Unfrozen at the end, so a process that trains several models in turn (tests, notebooks) still
    collects the cycles of the ones it dropped."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
