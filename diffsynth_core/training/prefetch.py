"""The next round's batch, read and drawn on the host while the GPU still computes this round.

After ``loss.backward()`` has queued the round's work, the host would only wait for the GPU
(reading the loss).  The trainer uses that wait to read the next round's samples from the cache,
draw their noise and timesteps, stack them and, on CUDA, pin them, so the next forward starts with
asynchronous copies instead of reads, draws and pageable copies while the GPU idles.  On the H200
(60-block Qwen-Image at 1024², zarr cache; bench/step_start.py, its results at 8b1d56c)
the host waited ≈ 32 ms for each round's loss, and preparing ahead cut the idle GPU at each step's
start from 25.9 to 16.0 ms; the rest was ``ModelMixin.dtype``, which the trainer now reads once.

Reading early changes no value: the batch order is the sampler's (peeked, not consumed, so the
sampler state a checkpoint saves is unchanged) and every draw depends on the sample's serial alone.
A batch that fails to prepare keeps its error, raised when the batch is used: the step that would
have read it anyway, so the step before it still completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .sampler import Batch


@dataclass
class HostBatch:
    """One batch ready on the host: its collated cache tensors, noise and noise levels."""
    inputs: dict[str, torch.Tensor]
    noise: torch.Tensor
    sigmas: torch.Tensor

    def pinned(self) -> "HostBatch":
        """The same tensors in page-locked memory (host->device copies can then run asynchronously)."""
        return HostBatch({k: _pin(v) for k, v in self.inputs.items()}, _pin(self.noise), _pin(self.sigmas))


def _pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if tensor.device.type == "cpu" else tensor  # a training set may hold device tensors


class NextBatch:
    """Holds at most one batch prepared ahead by ``prepare`` (or the error preparing it raised)."""

    def __init__(self, prepare: Callable[[Batch], HostBatch]):
        self.prepare = prepare
        self._held: tuple[Batch, HostBatch | None, Exception | None] | None = None

    def prepare_ahead(self, batch: Batch) -> None:
        try:
            self._held = (batch, self.prepare(batch), None)
        except Exception as err:  # noqa: BLE001 - raised by take(), at the step that uses the batch
            self._held = (batch, None, err)

    def take(self, batch: Batch) -> HostBatch:
        """``batch`` prepared: the one held if it is that batch, else prepared now."""
        held, self._held = self._held, None
        if held is None or held[0] != batch:
            return self.prepare(batch)
        if held[2] is not None:
            raise held[2]
        return held[1]
