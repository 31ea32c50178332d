"""One pinned host copy of the frozen weights per machine, shared by all its local ranks.

With N ranks per machine each training under offload, every rank would keep its own pinned copy
of the frozen DiT (Qwen-Image: N x 41 GB).  Here the machine's *leader* (its lowest global rank)
creates the arena as a file in ``/dev/shm``, every local rank maps the same pages (``MAP_SHARED``)
and page-locks its own mapping with ``cudaHostRegister`` (pinning is per process, the pages are
not), and only the leader copies the weights in.  Host RAM then holds the weights once per
machine, however many GPUs train.

Protocol (every rank attaches the same model in the same order, as data parallel already
requires; each step is one collective over the default process group):

1. each rank gathers (machine id, digest of a sample of its frozen weights): ranks of one machine
   must hold the same weights, or sharing would silently change the others' model;
2. the leader creates and sizes the file (if ``/dev/shm`` has room) and tells the others its name;
3. the others map it; every rank reports success, the leader then unlinks the file (mappings
   outlive the name: nothing is left behind in ``/dev/shm``, even after a crash);
4. the leader fills the arena, the others point their weights at it without copying; a barrier.

If any local rank cannot map the file (e.g. ranks in separate containers), every rank of that
machine falls back to a private arena, with a warning.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os
import socket
import uuid
import warnings

import torch
import torch.distributed as dist

from .arena import HostArena

SHM_DIR = "/dev/shm"
_SAMPLES = 64  # elements per tensor in the weights' digest
_counter = itertools.count()  # managers attached by this process, to name their arenas apart


class SharedHostArena(HostArena):
    """A ``HostArena`` whose bytes are a ``MAP_SHARED`` mapping of a ``/dev/shm`` file."""

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(nbytes, 1))
            self._map = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.nbytes, self.path, self.pinned = nbytes, path, False
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.leader = create

    def release(self) -> None:
        super().release()
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes when it does
            pass


def shared_host_arena(plan, pin: bool):
    """The plan's arena shared with the other ranks of this machine, filled; or None when the
    process is alone on its machine, the arena holds trainable weights (each rank's optimizer
    writes its own), or sharing is not possible here (then the caller makes a private one)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    if plan.host_trainable or not plan.arena_bytes:
        return None
    rank = dist.get_rank()
    peers = _gather((_machine_id(), _weights_digest(plan)))
    local = [r for r, (machine, _) in enumerate(peers) if machine == peers[rank][0]]
    if len(local) < 2:
        return None
    leader = min(local)
    bad = [r for r in local if peers[r][1] != peers[leader][1]]
    if bad:
        raise RuntimeError(f"offload: ranks {bad} hold other frozen weights than rank {leader} on the same machine; "
                           "data-parallel training needs every rank to load the same base model")
    arena = _map_shared(plan, rank, leader, local)
    if arena is not None:
        plan.fill_arena(arena, copy=arena.leader)
    dist.barrier()  # the leader's copy is complete before anyone computes with it
    if arena is not None and pin:
        arena.pin()  # after the fill: each process page-locks its own mapping of the filled pages
    return arena


def _map_shared(plan, rank: int, leader: int, local: list[int]) -> SharedHostArena | None:
    name = f"splitflow-arena-{uuid.uuid4().hex[:12]}-{leader}-{next(_counter)}"
    path = os.path.join(SHM_DIR, name)
    arena, error = None, None
    if rank == leader:
        arena, error = _try(lambda: _create(path, plan.arena_bytes))
    created = _gather(path if arena is not None else None)[leader]
    if rank != leader and created is not None:
        arena, error = _try(lambda: SharedHostArena(created, plan.arena_bytes, create=False))
    mapped = _gather(arena is not None)
    if rank == leader and created is not None:
        os.unlink(created)  # every local rank has mapped it (or given up): the name is no longer needed
    if all(mapped[r] for r in local):
        return arena
    if arena is not None:
        arena.release()
    warnings.warn(f"offload: cannot share the host copy of the weights between local ranks ({error or 'a peer failed'});"
                  " each rank keeps its own", RuntimeWarning, stacklevel=3)
    return None


def _create(path: str, nbytes: int) -> SharedHostArena:
    free = os.statvfs(SHM_DIR)
    if free.f_bavail * free.f_frsize < nbytes:
        raise OSError(f"{SHM_DIR} has {free.f_bavail * free.f_frsize / 2**30:.1f} GiB free, "
                      f"the weights need {nbytes / 2**30:.1f} GiB (docker: --shm-size)")
    return SharedHostArena(path, nbytes, create=True)


def _try(make):
    try:
        return make(), None
    except OSError as exc:
        return None, exc


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _machine_id() -> str:
    """Ranks with the same id share a ``/dev/shm`` (checked for real when mapping)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _weights_digest(plan) -> str:
    """A digest of a strided sample of every frozen weight the arena will hold (cheap, not a proof)."""
    digest = hashlib.sha256()
    for unit in plan.streamed:
        for rec in unit.tensors:
            flat = rec.param.data.reshape(-1)
            sample = flat[:: max(1, flat.numel() // _SAMPLES)][:_SAMPLES].detach().cpu().contiguous()
            digest.update(str((rec.shape, rec.store_dtype, rec.packed_base, rec.escapes)).encode())
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
