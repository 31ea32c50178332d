"""Optimizer state kept in host memory between steps (``offload.optimizer_state_on_host``).

An optimizer's state (AdamW: two fp32 moments per trainable weight) is read only inside
``optimizer.step()``, yet it sits on the GPU through every forward and backward, where memory
peaks: for a LoRA in fp32 it is twice the adapters' own bytes.  Here it lives in page-locked host
memory between steps.  A pre-hook of ``step()`` copies it in (stream-ordered after the previous
step's copies out), the optimizer steps on the GPU exactly as it would have (same kernels, same
values: bitwise the same update), and a post-hook queues the copies out on a side stream, which
run beside the next forward.  The activations of the step are freed by then, so the state comes
back into memory the peak does not use.

Cost: the state's bytes cross PCIe once each way per step; the copy in is on the step's path (the
optimizer cannot start before it), the copy out overlaps the next forward.  Scalars (AdamW's
``step`` count, on the GPU for the fused and capturable kernels) stay where they are.  Optimizer
state that is already on the host (``enable_optimizer_cpu_offload``) is left alone.  On a CPU the
same pages are kept and copied (host to host): pointless for memory, which is why the Trainer
attaches it on CUDA only, but it is how CPU tests check the bookkeeping.

``StatePage`` is the piece this, ``backward_steps.StepInBackward`` and ``device_steps.DeviceSteps``
page with: some weights' state in one host arena, copied to the device as one buffer and back as
one copy.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch
from torch import nn

from .arena import HostArena, host_copies, release_all


def moves_to_host(key: str, value, param: torch.Tensor, keys=None) -> bool:
    """State worth keeping on the host: a tensor on its weight's device, not a scalar (AdamW's
    ``step``), and one of ``keys`` when given."""
    return (keys is None or key in keys) and isinstance(value, torch.Tensor) and value.device == param.device \
        and value.numel() > 1


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


class StatePage:
    """Some weights' optimizer state, in one host arena (page-locked on CUDA) between steps.

    ``copy_in(stream)`` brings the arena to the device as one buffer, after this page's last copy
    out, and points the state entries still at home at views of it, which the optimizer updates
    in place; ``copy_out(stream)`` copies the buffer back as one copy (tensor by tensor when the
    optimizer made or replaced a tensor) and points the entries at their homes again.  ``stream``:
    the CUDA stream that copies (the caller's own, or a side stream; ``None`` on a CPU).  ``arrived``
    and ``copied_out``: the events of the last copies each way.  ``device``: where it goes (default:
    the first weight's; a streamed weight may be at home on the host when its page is made)."""

    def __init__(self, optimizer: torch.optim.Optimizer, entries: list[tuple[nn.Parameter, str, torch.Tensor]],
                 device: torch.device | None = None):
        self.optimizer = optimizer
        self.device = entries[0][0].device if device is None else device
        self.cuda = self.device.type == "cuda"
        self.arena, views = host_copies([value for _, _, value in entries], pin=self.cuda)
        self.layout = [(param, key, offset, home) for (param, key, _), (offset, home) in zip(entries, views)]
        self._index()
        self.on_device: torch.Tensor | None = None  # the state's device copy while it is in
        self.arrived: torch.cuda.Event | None = None
        self.copied_out: torch.cuda.Event | None = None

    def drop(self, gone: set[tuple[int, str]]) -> None:
        """Entries now kept elsewhere (their shape changed): the arena still copies their bytes."""
        self.layout = [entry for entry in self.layout if (id(entry[0]), entry[1]) not in gone]
        self._index()

    def _index(self) -> None:
        """What the layout gives, kept at hand: each entry's home, and where its device view starts
        (shape, strides, first element) so that copy_in makes each view in one op."""
        self.homes = {(id(param), key): home for param, key, _, home in self.layout}
        self.places = [(home.dtype, home.shape, home.stride(), offset // home.element_size())
                       for _, _, offset, home in self.layout]

    def copy_in(self, stream) -> int:
        """Bytes copied in (0 when in already, or when no entry is at home)."""
        state = self.optimizer.state
        at_home = [i for i, (p, k, _, home) in enumerate(self.layout) if state.get(p, {}).get(k) is home]
        if self.on_device is not None or not at_home:
            return 0
        on_device = torch.empty(self.arena.nbytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # its memory may be in use until here
            if self.copied_out is not None:
                stream.wait_event(self.copied_out)  # the last copy out writes what we read
        with _on(stream):
            on_device.copy_(self.arena.buffer[:self.arena.nbytes], non_blocking=True)
            if self.cuda:
                self.arrived = stream.record_event()
                on_device.record_stream(stream)
        typed = {dtype: on_device.view(dtype) for dtype in {place[0] for place in self.places}}
        for i in at_home:  # one op a view: a step's host time grows with the entries (thousands for a LoRA)
            p, k, _, _ = self.layout[i]
            dtype, shape, stride, first = self.places[i]
            state[p][k] = typed[dtype].as_strided(shape, stride, first)
        self.on_device = on_device
        return self.arena.nbytes

    def put_back(self) -> None:
        """Came in and was not stepped: the entries point at their homes again (unchanged: no copy)."""
        state = self.optimizer.state
        for p, k, _, home in self.layout:
            if k in state.get(p, {}):
                state[p][k] = home
        self.on_device = None

    def in_place(self) -> bool:
        """Came in, and every entry is still the view of the device buffer the optimizer updated."""
        if self.on_device is None:
            return False
        state, base = self.optimizer.state, self.on_device.data_ptr()
        return all((v := state.get(p, {}).get(k)) is not None and v.data_ptr() == base + off
                   for p, k, off, _ in self.layout)

    def copy_out(self, stream, in_place: bool | None = None) -> int:
        """Bytes copied out (0 when every entry is at home already); ``in_place``: ``in_place()``,
        when the caller has asked already."""
        state = self.optimizer.state
        values = [state.get(p, {}).get(k) for p, k, _, _ in self.layout]
        if in_place is None:
            in_place = self.in_place()
        if in_place:
            pairs, nbytes = [(self.arena.buffer[:self.arena.nbytes], self.on_device)], self.arena.nbytes
        else:  # state the optimizer made or replaced
            pairs = [(home, v) for v, (_, _, _, home) in zip(values, self.layout)
                     if isinstance(v, torch.Tensor) and v is not home]
            nbytes = sum(v.nbytes for _, v in pairs)
        if pairs:
            if self.cuda:
                stream.wait_stream(torch.cuda.current_stream(self.device))  # after the step wrote the state
            with _on(stream):
                for home, value in pairs:
                    home.copy_(value, non_blocking=True)
                    if self.cuda:
                        value.record_stream(stream)  # its memory is reused only once the copy has read it
                if self.cuda:
                    self.copied_out = stream.record_event()
        for (p, k, _, home), v in zip(self.layout, values):
            if v is not None:
                state[p][k] = home
        self.on_device = None
        return nbytes


class HostOptimizerState:
    """Keeps ``optimizer``'s per-parameter tensor state in host memory between steps.

    Works for any optimizer that keeps its state in ``optimizer.state[param]`` and only reads it in
    ``step()``.  The state is kept in ``StatePage`` s (one per batch of new state, normally one for
    all), each copied in as one buffer and out as one copy (a launch per tensor would cost the host
    ~10 us each, thousands a step for a DiT's LoRA).  ``state_dict()`` waits for the copies out;
    ``load_state_dict()`` (which puts the state on the parameters' device) sends it straight back.
    ``keys``: only these state entries (e.g. ``("exp_avg_sq",)``: half of AdamW's state for half the
    copies); ``None``: all.  ``stats``: bytes held on the host and copied each way."""

    def __init__(self, optimizer: torch.optim.Optimizer, keys: tuple[str, ...] | None = None):
        self.optimizer = optimizer
        self.keys = keys
        self.pages: list[StatePage] = []
        self.page_of: dict[tuple[int, str], StatePage] = {}
        self.entries = -1  # state entries (tensors and scalars) after the last step
        self.stream: torch.cuda.Stream | None = None  # the copies out
        self.stats = {"host_bytes": 0, "h2d_bytes": 0, "d2h_bytes": 0, "steps": 0}
        self.handles = [optimizer.register_step_pre_hook(self._bring_in),
                        optimizer.register_step_post_hook(self._send_out),
                        optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
                        optimizer.register_load_state_dict_post_hook(self._after_load)]
        self._arenas: list[HostArena] = []  # every page's, for the finalizer to unpin
        weakref.finalize(self, release_all, self._arenas)

    def _bring_in(self, optimizer, args, kwargs) -> None:
        for page in self.pages:  # on the step's own stream: the optimizer reads it next
            stream = torch.cuda.current_stream(page.device) if page.cuda else None
            self.stats["h2d_bytes"] += page.copy_in(stream)

    def _send_out(self, optimizer, args, kwargs) -> None:
        # A step that only updated what came in (as many state entries as before, each still a view
        # of its page's buffer) needs no look at every entry: thousands a step for a DiT's LoRA.
        entries = sum(map(len, optimizer.state.values()))
        in_place = [page.in_place() for page in self.pages]
        if entries != self.entries or not all(in_place):
            self._home_new_state(optimizer)
            self.entries = entries
            in_place = [None] * len(self.pages)
        if not self.pages:
            return
        if self.stream is None and self.pages[0].cuda:
            self.stream = torch.cuda.Stream(self.pages[0].device)
        for page, whole in zip(self.pages, in_place):  # beside the next forward
            self.stats["d2h_bytes"] += page.copy_out(self.stream, whole)
        self.stats["steps"] += 1

    def _home_new_state(self, optimizer) -> None:
        """New state, or state whose shape changed, gets a page of its own."""
        new = [(param, key, value) for group in optimizer.param_groups for param in group["params"]
               for key, value in optimizer.state.get(param, {}).items()
               if moves_to_host(key, value, param, self.keys) and not self._has_home(param, key, value)]
        if not new:
            return
        gone = {(id(p), k) for p, k, _ in new}
        for page in self.pages:
            page.drop(gone)
        page = StatePage(optimizer, new)
        self.pages.append(page)
        self.page_of.update({key: page for key in gone})
        self._arenas.append(page.arena)
        self.stats["host_bytes"] += page.arena.nbytes

    def _has_home(self, param, key, value) -> bool:
        page = self.page_of.get((id(param), key))
        home = page.homes.get((id(param), key)) if page is not None else None
        return home is not None and home.shape == value.shape and home.dtype == value.dtype

    def _after_load(self, optimizer) -> None:
        """``load_state_dict`` placed the state on the device: back to the host before any forward."""
        self._send_out(optimizer, (), {})
        self.wait()

    def wait(self) -> None:
        """Block until the queued copies out have landed (before the host reads the state)."""
        if self.stream is not None:
            self.stream.synchronize()

    def remove(self) -> None:
        """Stop moving the state (it stays where it is: on the host after a step)."""
        self.wait()
        for handle in self.handles:
            handle.remove()
