"""A resumable, seeded order of batches: samples of equal latent shape (a *bucket*) batched together.

Each epoch's batches are a pure function of (seed, epoch), never of the world size:

1. the dataset, ``repeat`` times over, is permuted;
2. samples are grouped by bucket, keeping the permuted order;
3. each bucket is cut into batches of ``batch_size``; its last batch, when smaller, is trained or
   dropped (``drop_last``);
4. the batches are shuffled across buckets;
5. the list is cut to a multiple of the world size, and each *round* of ``world_size`` batches gives
   batch ``rank`` to each rank (ranks get whole batches).

Every sample drawn has a *serial* (its place in the epoch's batch list, counted in slots of
``batch_size``), from which its noise, timestep and caption dropout are drawn.  So a resumed run needs
only ``(epoch, position)``, every rank holds the same state, and one process accumulating
``world_size`` batches per step trains exactly what ``world_size`` ranks do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ..errors import InputError


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # batches of this epoch's list already consumed, all ranks together


@dataclass(frozen=True)
class Batch:
    indices: tuple[int, ...]  # sample indices into the training set
    serials: tuple[int, ...]  # each sample's draw serial (seeds its noise, timestep, caption dropout)
    bucket: Hashable          # what its samples share (their latent shape, and their reference latents' shapes)


@dataclass(frozen=True)
class BucketCount:
    bucket: Hashable
    samples: int        # per epoch, repeats included
    full_batches: int
    last_batch: int     # size of the smaller last batch (0: none)


class BucketSampler:
    def __init__(self, buckets: Sequence[Hashable], batch_size: int = 1, drop_last: bool = False,
                 repeat: int = 1, seed: int = 0, rank: int = 0, world_size: int = 1):
        if not buckets:
            raise InputError("the training set is empty: nothing to sample")
        self.buckets, self.batch_size, self.drop_last = list(buckets), batch_size, drop_last
        self.repeat, self.seed, self.rank, self.world_size = repeat, seed, rank, world_size
        self.counts = self._count()
        self._kept = sum(c.full_batches + (c.last_batch > 0 and not drop_last) for c in self.counts)
        self.batches_per_epoch = self._kept - self._kept % world_size  # whole rounds only
        self._serials_per_epoch = self._kept * batch_size
        if self.batches_per_epoch == 0:
            raise InputError(self._too_few_batches())
        self.state = SamplerState()
        self._epoch, self._batches = -1, []

    # -- what an epoch holds ------------------------------------------------------------------
    def _count(self) -> list[BucketCount]:
        sizes: dict[Hashable, int] = {}
        for bucket in self.buckets:
            sizes[bucket] = sizes.get(bucket, 0) + self.repeat
        return [BucketCount(b, n, n // self.batch_size, n % self.batch_size) for b, n in sizes.items()]

    def _too_few_batches(self) -> str:
        largest = max(c.samples for c in self.counts)
        if self._kept == 0:
            return (f"train.batch_size = {self.batch_size} with train.drop_last = true leaves no batch: the largest "
                    f"bucket holds {largest} samples; lower batch_size or set drop_last = false")
        return f"{self._kept} batches per epoch cannot feed {self.world_size} ranks; lower train.batch_size"

    @property
    def rounds_per_epoch(self) -> int:
        return self.batches_per_epoch // self.world_size

    def describe(self) -> str:
        """One line per bucket: samples, batches, and what happens to a smaller last batch."""
        lines = []
        for c in self.counts:
            tail = "" if not c.last_batch else (
                f", last batch of {c.last_batch} {'dropped' if self.drop_last else 'trained'}")
            lines.append(f"bucket {format_bucket(c.bucket)}: {c.samples} samples -> {c.full_batches} batches "
                         f"of {self.batch_size}{tail}")
        if self._kept != self.batches_per_epoch:
            lines.append(f"{self._kept - self.batches_per_epoch} batches per epoch left out so that "
                         f"{self.world_size} ranks get whole rounds")
        return "\n".join(lines)

    # -- the order ----------------------------------------------------------------------------
    def _epoch_batches(self, epoch: int) -> list[Batch]:
        if self._epoch == epoch:
            return self._batches
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        n = len(self.buckets)
        grouped: dict[Hashable, list[int]] = {}
        for item in torch.randperm(n * self.repeat, generator=generator).tolist():
            grouped.setdefault(self.buckets[item % n], []).append(item % n)
        chunks = [(bucket, members[i: i + self.batch_size]) for bucket, members in grouped.items()
                  for i in range(0, len(members), self.batch_size)]
        chunks = [c for c in chunks if len(c[1]) == self.batch_size or not self.drop_last]
        order = torch.randperm(len(chunks), generator=generator).tolist()
        base = epoch * self._serials_per_epoch
        self._batches = [
            Batch(tuple(chunks[k][1]), tuple(base + slot * self.batch_size + j for j in range(len(chunks[k][1]))),
                  chunks[k][0])
            for slot, k in enumerate(order[: self.batches_per_epoch])]
        self._epoch = epoch
        return self._batches

    def next_round(self) -> list[Batch]:
        """The next ``world_size`` batches: batch ``rank`` is this rank's."""
        self.state = self._upcoming()
        round_ = self._round_at(self.state)
        self.state.position += self.world_size
        return round_

    def peek_round(self) -> list[Batch]:
        """The round ``next_round`` will return, without consuming it (the state checkpoints save
        stays where it is)."""
        return self._round_at(self._upcoming())

    def _round_at(self, state: SamplerState) -> list[Batch]:
        return self._epoch_batches(state.epoch)[state.position: state.position + self.world_size]

    def _upcoming(self) -> SamplerState:
        """Where the next round starts: the next epoch once this one's rounds are consumed."""
        if self.state.position >= self.batches_per_epoch:
            return SamplerState(self.state.epoch + 1, 0)
        return SamplerState(self.state.epoch, self.state.position)


def format_bucket(bucket: Hashable) -> str:
    """``(16, 1, 12, 16)`` -> ``16x1x12x16`` (metrics.csv and logs); a bucket with reference latents,
    ``((16, 1, 12, 16), (16, 1, 8, 8))``, -> ``16x1x12x16+16x1x8x8``."""
    if isinstance(bucket, tuple) and bucket and all(isinstance(part, tuple) for part in bucket):
        return "+".join(format_bucket(part) for part in bucket)
    return "x".join(str(d) for d in bucket) if isinstance(bucket, tuple) else str(bucket)
