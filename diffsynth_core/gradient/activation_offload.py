"""Checkpointed block inputs kept in host memory between forward and backward, copied off the
critical path.

With per-block checkpointing the only activations a step keeps across the forward->backward turn
are each block's inputs (``torch.utils.checkpoint`` saves them through ``_NoopSaveInputs``, which
goes through the saved-tensor hooks active around the ``checkpoint`` call).  For a deep stack at a
long sequence that is most of the activation memory: 24 blocks x 4096 tokens x 3072 x bf16 =
0.56 GiB.  ``torch.autograd.graph.save_on_cpu`` moves them to the host, but on the compute stream
and synchronously (each pack waits for its copy), and brings each back only when the recompute
asks for it.  Here:

* **pack** (forward): the input is copied device->host on a private stream, after the compute
  that produced it; ``record_stream`` keeps the allocator from reusing its memory until the copy
  has run, and the device tensor is dropped at once (the compute stream never waits);
* **unpack** (backward): the input comes back host->device on another private stream; while one
  block's recompute runs, the input packed just before it (the next one backward needs) is
  already on its way, so the compute stream only waits for a copy that has landed.

So at most two block inputs are on the device in backward.  A tensor packed again while still
alive (an embedding passed to every block) is copied to the host once, and one the caller still
holds unchanged when backward needs it (the model's input) is handed back as is, not copied.

Host buffers are page-locked once, at their exact size (``HostBuffers``), and reused step after
step: a buffer comes back when autograd drops its saved tensor, and the next copy into it waits (on
the GPU) for the copies that last read and wrote it.  Not PyTorch's pinned caching allocator
(``torch.empty(pin_memory=True)``): in a compiled Qwen-Image step with offloaded inputs on the H200
the host spent 7.6 % of its samples in that call (py-spy), and it rounds every buffer up to a power
of two (host RAM).  On a CPU device there is nothing to move: tensors pass through.
"""

from __future__ import annotations

import weakref

import torch

from ..offload.arena import HostArena, release_all, typed_view

# Smaller tensors (scalars, modulation vectors) are not worth a copy and an event each.
MIN_BYTES = 1 << 20


class HostBuffers:
    """Page-locked host buffers of exact sizes, handed out and taken back, never freed mid-run.

    ``take(nbytes)`` returns a buffer and the CUDA events its next writer must wait for (the copies
    that last wrote and read it); ``give(buffer, events)`` takes it back.  Idle buffers are kept up
    to the most bytes ever in use at once, so a run whose shapes never change allocates in its
    first step only, and one whose shapes do (resolution buckets) holds about twice its largest
    working set at most (a buffer a copy still touches is kept even over that).
    """

    def __init__(self, pin: bool = True):
        self.pin = pin
        self.idle: dict[int, list[tuple[HostArena, list]]] = {}
        self.all: list[HostArena] = []  # every buffer made, to unpin at the end
        self.idle_bytes = self.live_bytes = self.most_live_bytes = 0
        self.allocations = 0
        weakref.finalize(self, release_all, self.all)

    def take(self, nbytes: int) -> tuple[HostArena, list]:
        kept = self.idle.get(nbytes)
        if kept:
            buffer, after = kept.pop()
            self.idle_bytes -= nbytes
        else:
            buffer, after = HostArena(nbytes), []
            if self.pin:
                buffer.pin()
            self.all.append(buffer)
            self.allocations += 1
        self.live_bytes += nbytes
        self.most_live_bytes = max(self.most_live_bytes, self.live_bytes)
        return buffer, after

    def give(self, buffer: HostArena, after: list) -> None:
        self.live_bytes -= buffer.nbytes
        if self.idle_bytes + buffer.nbytes > self.most_live_bytes and all(e.query() for e in after):
            self._drop(buffer)  # more idle than ever used at once, and no copy still touches it
            return
        self.idle.setdefault(buffer.nbytes, []).append((buffer, after))
        self.idle_bytes += buffer.nbytes

    def _drop(self, buffer: HostArena) -> None:
        buffer.release()
        self.all.remove(buffer)


class _Saved:
    """One packed tensor: its host copy, and its device copy while fetched for backward."""

    __slots__ = ("buffer", "host", "device", "d2h_done", "last_read", "gpu", "ready", "prev", "origin",
                 "version", "pool", "__weakref__")

    def __init__(self, pool: HostBuffers, buffer: HostArena, host, device, d2h_done, prev, origin: torch.Tensor):
        self.pool, self.buffer, self.host, self.device, self.d2h_done = pool, buffer, host, device, d2h_done
        self.gpu, self.ready, self.last_read = None, None, None
        self.prev = prev  # weakref to the _Saved packed just before: what backward needs next
        self.origin = weakref.ref(origin)  # the device tensor, while something else keeps it alive
        self.version = origin._version

    def __del__(self):  # autograd let go of it: the buffer serves a later pack
        events = [e for e in (self.d2h_done, self.last_read) if e is not None]
        self.pool.give(self.buffer, events)

    def alive(self) -> torch.Tensor | None:
        """The device tensor itself, if the caller still holds it unchanged (nothing to copy back)."""
        t = self.origin()
        return t if t is not None and t._version == self.version else None


class ActivationOffloader:
    """Saved-tensor hooks (``hooks()``) that keep large CUDA tensors in pinned host memory."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self.last: weakref.ref | None = None  # the _Saved packed most recently
        self.live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(tensor) -> _Saved
        self.host = HostBuffers()
        self.d2h_bytes = 0
        self.h2d_bytes = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _streams(self, device: torch.device):
        if device not in self.streams:
            self.streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self.streams[device]

    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if not t.is_cuda or nbytes < self.min_bytes:
            return t
        known = self.live.get(id(t))
        if known is not None and known.alive() is t:  # packed before, alive and unchanged: one host copy
            return known
        d2h, _ = self._streams(t.device)
        buffer, after = self.host.take(nbytes)
        host = typed_view(buffer.buffer, 0, t.dtype, t.shape)
        d2h.wait_stream(torch.cuda.current_stream(t.device))  # after the compute that produced t
        for event in after:  # and after the copies that last wrote and read the buffer
            d2h.wait_event(event)
        with torch.cuda.stream(d2h):
            host.copy_(t, non_blocking=True)
            done = d2h.record_event()
        t.record_stream(d2h)  # its memory is reused only after the copy has read it
        self.d2h_bytes += nbytes
        saved = _Saved(self.host, buffer, host, t.device, done, self.last, t)
        self.last = weakref.ref(saved)
        self.live[id(t)] = saved
        return saved

    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        out = saved.alive()  # e.g. the model's input, or a tensor every block takes
        if out is None:
            if saved.gpu is None:
                self._fetch(saved)
            out, ready = saved.gpu, saved.ready
            torch.cuda.current_stream(out.device).wait_event(ready)
        saved.gpu = saved.ready = None  # the consumer holds it now; freed when it is done
        prev = saved.prev() if saved.prev is not None else None
        if prev is not None and prev is not saved and prev.gpu is None and prev.alive() is None:
            self._fetch(prev)  # backward needs it next: copy it while this one's block computes
        return out

    def _fetch(self, saved: _Saved) -> None:
        """Start the host->device copy of ``saved`` on the private stream."""
        _, h2d = self._streams(saved.device)
        # Allocated on the compute stream (where it is used and freed); the copy waits for the
        # compute queued so far, which may still read memory the allocator just handed out.
        gpu = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        h2d.wait_stream(torch.cuda.current_stream(saved.device))
        h2d.wait_event(saved.d2h_done)
        with torch.cuda.stream(h2d):
            gpu.copy_(saved.host, non_blocking=True)
            saved.ready = saved.last_read = h2d.record_event()
        gpu.record_stream(h2d)  # dropped unused (its original came back), it is not reused mid-copy
        saved.gpu = gpu
        self.h2d_bytes += gpu.numel() * gpu.element_size()
