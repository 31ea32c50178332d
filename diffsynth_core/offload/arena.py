"""One host buffer for every streamed weight, pinned once, carved into per-unit regions.

Why not ``tensor.pin_memory()`` per weight: PyTorch's caching host allocator rounds each request
up to a power of two (50-100% more RAM on a DiT).  We allocate one plain host tensor of exactly the
bytes needed (64-byte aligned regions) and page-lock it in place with ``cudaHostRegister``.  Where
there is no CUDA, or registration fails, the arena stays pageable and we warn once.

The manager creates its arena through one factory, ``host_arena_factory(nbytes) -> arena``
(default :class:`HostArena`), so another host memory (e.g. one shared-memory copy per machine) can
be plugged in.  An arena offers ``buffer`` (uint8 tensor of ``nbytes``), ``nbytes``, ``pinned``,
``region(off, n)``, ``pin()`` and ``release()``.  The manager fills it first and pins it after:
pages are only touched as weights are copied in (while the originals are dropped one by one), so
host RAM never holds two copies of the model; page-locking an empty arena would commit all of it
up front.
"""

from __future__ import annotations

import warnings

import torch

from .units import align_up

_warned_pageable = False


def _warn_pageable(reason: str) -> None:
    global _warned_pageable
    if not _warned_pageable:
        _warned_pageable = True
        warnings.warn(f"offload: host memory stays pageable ({reason}); copies between host and device "
                      "will be several times slower", RuntimeWarning, stacklevel=3)


class HostArena:
    """``nbytes`` of host memory (uint8); ``pin()`` page-locks it; ``region(off, n)`` is a view."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned = False

    def pin(self) -> None:
        """Page-lock the buffer in place (``cudaHostRegister``); warn once and stay pageable if impossible."""
        if not torch.cuda.is_available():
            _warn_pageable("CUDA is not available")
            return
        try:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            code = int(getattr(err, "value", err))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister returned {err}")
            self.pinned = True
        except Exception as exc:  # noqa: BLE001 - any failure means "not pinned"; we fall back
            _clear_cuda_error()
            _warn_pageable(f"pinning {self.nbytes / 2**30:.1f} GiB failed: {exc}")

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer.narrow(0, offset, nbytes)

    def release(self) -> None:
        """Unpin and drop the arena's own reference; tensors still viewing it keep the memory alive
        (that is how ``detach()`` hands weights back without a copy)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.buffer = torch.empty(0, dtype=torch.uint8)


def _clear_cuda_error() -> None:
    """A failed runtime call leaves its error pending, and the next kernel launch would raise it from
    an unrelated op (seen as ``torch.zeros`` failing with "memory range is already mapped"): one
    throwaway launch takes it now."""
    try:
        torch.empty(1, device="cuda").zero_()
    except Exception:  # noqa: BLE001 - that is the pending error, consumed
        pass


def typed_view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over ``buf`` (uint8) starting at byte ``offset``."""
    n = shape.numel() * dtype.itemsize
    return buf.narrow(0, offset, n).view(dtype).view(shape)


def host_copies(tensors, pin: bool) -> tuple[HostArena, list[tuple[int, torch.Tensor]]]:
    """One arena with room for a copy of each of ``tensors`` (64-byte aligned), page-locked when
    ``pin``; per tensor, its offset and a host view of its dtype and shape (not filled)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total = align_up(total + t.numel() * t.element_size())
    arena = HostArena(total)
    if pin:
        arena.pin()
    return arena, [(off, typed_view(arena.buffer, off, t.dtype, t.shape)) for t, off in zip(tensors, offsets)]


def release_all(arenas: list[HostArena]) -> None:
    """Unpin and drop ``arenas`` once no queued copy can touch them (their owners' finalizers)."""
    if any(a.pinned for a in arenas):
        torch.cuda.synchronize()
    for arena in arenas:
        arena.release()  # tensors still viewing one keep its (now pageable) memory
