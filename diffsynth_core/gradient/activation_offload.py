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
  block's recompute runs, the inputs of the block before it (packed under the previous
  ``hooks()``, and needed next by backward) are already on their way, and so are those of the
  block before that (``ahead``, default 2 blocks): a copy back starts only once the compute queued
  before it has run, and on the H200 the copy engine ran it after the weight copy of a streamed
  block issued just before it (12 ms for a Qwen-Image block), so with one block ahead a block of
  8 ms waited ~5 ms for its 28 MB input (38 such waits, 142 ms of a compiled 24 GB step); two
  ahead, it lands behind the same weight copy a block earlier.

So at most ``ahead + 1`` blocks' inputs are on the device in backward.  A tensor packed again
while still alive (an embedding passed to every block) is copied to the host once, and one the
caller still holds unchanged when backward needs it (the model's input) is handed back as is, not
copied; the prefetch passes over both (a shared tensor's unpack, at every block, prefetches nothing), and
over inputs already brought back.  The tensors packed under the latest ``hooks()`` call (the last
block's inputs) are held on the device until the next block starts or their unpack: backward needs
them first, with no compute before it to hide their copy back (on the H200 that copy was a 0.47 ms
idle stretch of the compute stream at every forward->backward turn, 0.17 % of the 24x3072 stack's
step); in forward they would be freed as the next block starts anyway.

Host buffers are page-locked once, at their exact size (``HostBuffers``), and reused step after
step: a buffer comes back when autograd drops its saved tensor, and the next copy into it waits (on
the GPU) for the copies that last read and wrote it.  Not PyTorch's pinned caching allocator
(``torch.empty(pin_memory=True)``): in a compiled Qwen-Image step with offloaded inputs on the H200
the host spent 7.6 % of its samples in that call (py-spy), and it rounds every buffer up to a power
of two (host RAM).  On a CPU device there is nothing to move: tensors pass through.
Call ``hooks()`` once per block (``checkpoint.py`` does): each call starts the group of tensors
that backward's recompute of that block unpacks together.
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

    __slots__ = ("buffer", "host", "device", "d2h_done", "last_read", "gpu", "ready", "group", "origin",
                 "version", "pool", "shared", "used", "__weakref__")

    def __init__(self, pool: HostBuffers, buffer: HostArena, host, device, d2h_done, group: int,
                 origin: torch.Tensor):
        self.pool, self.buffer, self.host, self.device, self.d2h_done = pool, buffer, host, device, d2h_done
        self.gpu, self.ready, self.last_read = None, None, None
        self.group = group  # the block (``hooks()`` call) that packed it
        self.shared = False  # packed again by a later block (a tensor every block takes)
        self.used = False  # unpacked already: no prefetch brings it back again
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
    """Saved-tensor hooks (``hooks()``) that keep large CUDA tensors in pinned host memory.

    ``cpu_tensors=True`` (tests): CPU tensors go through the same bookkeeping with synchronous
    copies into unpinned buffers, so what is copied, held and prefetched can be checked without a GPU."""

    def __init__(self, min_bytes: int = MIN_BYTES, cpu_tensors: bool = False, ahead: int = 2):
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1 (blocks whose inputs are brought back early), got {ahead}")
        self.min_bytes, self.cpu_tensors, self.ahead = min_bytes, cpu_tensors, ahead
        self.streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self.group = 0  # hooks() calls so far: the block packing now
        self.groups: dict[int, list[weakref.ref]] = {}  # block -> its _Saved, for the prefetch
        self.held: list[torch.Tensor] = []  # what the latest block packed, kept until the next block starts
        self.live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(tensor) -> _Saved
        self.host = HostBuffers(pin=not cpu_tensors)
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.fetched_on_demand = 0  # unpacks that found their tensor not on its way: compute waits for it

    def stats(self) -> dict:
        """Bytes moved each way, fetches the prefetch did not start (backward waited for those), and
        the page-locked host buffers held, since the offloader was made."""
        return {"d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes,
                "fetched_on_demand": self.fetched_on_demand,
                "host_buffer_bytes": sum(b.nbytes for b in self.host.all),
                "host_buffer_allocations": self.host.allocations}

    def hooks(self):
        """The hooks for one block's ``checkpoint`` call."""
        self.group += 1
        self.held = []  # the block before is done: its inputs are no longer the last ones
        if len(self.groups) > 256:  # forward-only runs never unpack: forget the blocks gone since
            self.groups = {g: refs for g, refs in self.groups.items() if any(r() is not None for r in refs)}
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _streams(self, device: torch.device):
        if device not in self.streams:
            self.streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self.streams[device]

    def pack(self, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if not (t.is_cuda or self.cpu_tensors) or nbytes < self.min_bytes:
            return t
        known = self.live.get(id(t))
        if known is not None and known.alive() is t:  # packed before, alive and unchanged: one host copy
            known.shared = True
            return known
        buffer, after = self.host.take(nbytes)
        host = typed_view(buffer.buffer, 0, t.dtype, t.shape)
        done = self._copy_out(t, host, after)
        self.d2h_bytes += nbytes
        saved = _Saved(self.host, buffer, host, t.device, done, self.group, t)
        self.groups.setdefault(self.group, []).append(weakref.ref(saved))
        self.live[id(t)] = saved
        self.held.append(t)
        return saved

    def unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        out = saved.alive()  # e.g. the model's input, a tensor every block takes, or one ``held``
        if out is not None and self.held:
            self.held = [t for t in self.held if t is not out]  # the consumer holds it now
        if out is None:
            if saved.gpu is None:
                self.fetched_on_demand += 1
                self._fetch(saved)
            out, ready = saved.gpu, saved.ready
            if ready is not None:
                torch.cuda.current_stream(out.device).wait_event(ready)
        saved.gpu = saved.ready = None  # the consumer holds it now; freed when it is done
        saved.used = True
        if not saved.shared:  # every block unpacks a shared one: it says nothing of what comes next
            for back in range(1, self.ahead + 1):
                self._prefetch(saved.group - back)
            self.groups.pop(saved.group, None)  # its block is being recomputed: nobody prefetches it now
        return out

    def _prefetch(self, group: int) -> None:
        """Start bringing back the inputs of block ``group`` (backward recomputes it within
        ``ahead`` blocks) while the current block computes: those not handed back as they are,
        not used, not on their way."""
        for ref in self.groups.get(group, ()):
            saved = ref()
            if saved is not None and not saved.used and saved.gpu is None and saved.alive() is None:
                self._fetch(saved)

    def _copy_out(self, t: torch.Tensor, host: torch.Tensor, after: list):
        """Copy ``t`` into ``host`` once the events ``after`` have passed (on CUDA on the private
        stream, after the compute that produced ``t``); returns the event that says it is done."""
        if not t.is_cuda:
            host.copy_(t)
            return None
        d2h, _ = self._streams(t.device)
        d2h.wait_stream(torch.cuda.current_stream(t.device))  # after the compute that produced t
        for event in after:  # and after the copies that last wrote and read the buffer
            d2h.wait_event(event)
        with torch.cuda.stream(d2h):
            host.copy_(t, non_blocking=True)
            done = d2h.record_event()
        t.record_stream(d2h)  # its memory is reused only after the copy has read it
        return done

    def _fetch(self, saved: _Saved) -> None:
        """Start the host->device copy of ``saved`` on the private stream."""
        # Allocated on the compute stream (where it is used and freed); the copy waits for the
        # compute queued so far, which may still read memory the allocator just handed out.
        gpu = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        self.h2d_bytes += gpu.numel() * gpu.element_size()
        if saved.device.type != "cuda":
            saved.gpu = gpu.copy_(saved.host)
            return
        _, h2d = self._streams(saved.device)
        h2d.wait_stream(torch.cuda.current_stream(saved.device))
        h2d.wait_event(saved.d2h_done)
        with torch.cuda.stream(h2d):
            gpu.copy_(saved.host, non_blocking=True)
            saved.ready = saved.last_read = h2d.record_event()
        gpu.record_stream(h2d)  # dropped unused (its original came back), it is not reused mid-copy
        saved.gpu = gpu
