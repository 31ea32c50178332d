"""A resumable, seeded sample order: epoch-wise permutations split across data-parallel ranks.

The whole order is a pure function of (seed, epoch, rank, world size), so a resumed run only
needs ``(epoch, position)`` to continue exactly where an uninterrupted run would be.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ..errors import InputError


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # samples of this rank's epoch order already consumed


class ResumableSampler:
    def __init__(self, num_samples: int, repeat: int = 1, seed: int = 0, rank: int = 0, world_size: int = 1):
        if num_samples <= 0:
            raise InputError("the training set is empty: nothing to sample")
        self.num_samples, self.repeat, self.seed = num_samples, repeat, seed
        self.rank, self.world_size = rank, world_size
        self.state = SamplerState()
        self._order_epoch, self._order = -1, []

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank sees per epoch (the tail that does not split evenly is dropped)."""
        return (self.num_samples * self.repeat) // self.world_size

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.num_samples * self.repeat, generator=generator)
            mine = perm[: self.samples_per_epoch * self.world_size][self.rank:: self.world_size]
            self._order = [int(i) % self.num_samples for i in mine]
            self._order_epoch = epoch
        return self._order

    def next_index(self) -> tuple[int, int]:
        """The next sample index and its draw serial: the position of this draw in the
        global (all-rank) order, the same whatever the world size, so noise seeded from it
        makes a data-parallel run match a single process accumulating the same samples."""
        if self.state.position >= self.samples_per_epoch:
            self.state = SamplerState(self.state.epoch + 1, 0)
        index = self._epoch_order(self.state.epoch)[self.state.position]
        global_per_epoch = self.samples_per_epoch * self.world_size
        serial = self.state.epoch * global_per_epoch + self.state.position * self.world_size + self.rank
        self.state.position += 1
        return index, serial
