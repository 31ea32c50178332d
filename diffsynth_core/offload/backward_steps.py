"""Optimizer steps taken during backward, their state paged in from host memory (library use).

``HostOptimizerState`` keeps the optimizer's state on the host but has to copy it all back in
before ``step()``, on the step's path, because backward has just used the memory at its peak.
Here each trainable weight's step runs as soon as backward has produced its gradient, so the state
is needed a page at a time, while backward still runs and the PCIe link is mostly idle (a streamed
backward copies a block per block's recompute and backward, far less than it could):

- weights are grouped into *pages* in the order their gradients arrive (learned in the first step;
  about ``page_bytes`` of weights each); a page's state lives in one pinned host arena;
- when a page's first gradient arrives, the next ``ahead`` pages' state is copied in on a side
  stream; when all its gradients have arrived, the page steps (the user's optimizer class and
  hyper-parameters over its weights, sharing ``optimizer.state``), its gradients are freed and its
  state is copied out on another side stream, as one copy;
- ``optimizer.step()`` then finds no gradient and does nothing; ``optimizer.state_dict()`` waits for
  the copies out.

So neither the optimizer state nor more than a page or two of gradients is ever on the GPU at the
backward's peak.  Element-wise optimizers (Adam, AdamW, SGD, ...) update each weight from its own
gradient and state, so the result is bitwise that of one ``step()`` after backward.  What it
requires, like ``bind_optimizer(overlap_backward=True)``: one backward per ``optimizer.step()``
(no gradient accumulation: a second backward raises), no gradient clipping, no skipping a step
over a non-finite gradient (weights have moved before backward ends), one process (no gradient
averaging between ranks).  The Trainer therefore does not use it; its
``offload.optimizer_state_on_host`` is ``HostOptimizerState``.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from .arena import HostArena, typed_view
from .host_optimizer import sub_optimizer
from .units import align_up


class _Page:
    """Weights stepped together, and where their state lives between steps."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index, self.params = index, params
        self.sub: torch.optim.Optimizer | None = None
        self.groups: list[int] = []  # the user's group of each of sub's groups
        self.arena: HostArena | None = None
        self.layout: list[tuple[nn.Parameter, str, int, torch.Tensor]] = []  # param, key, offset, host view
        self.on_device: torch.Tensor | None = None  # the state's device copy while paged in
        self.arrived: torch.cuda.Event | None = None  # its copy in
        self.copied_out: torch.cuda.Event | None = None  # its last copy out
        self.ready: set[int] = set()  # ids of the weights whose gradient arrived in this backward


class StepInBackward:
    """Steps ``optimizer`` page by page during backward; see the module docstring.
    ``stats``: pages stepped, bytes of state copied each way, copies in that were not prefetched."""

    def __init__(self, optimizer: torch.optim.Optimizer, page_bytes: int = 8 * 2**20, ahead: int = 2):
        self.optimizer, self.page_bytes, self.ahead = optimizer, page_bytes, ahead
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"StepInBackward needs every trainable weight on one device, got {devices}")
        self.device = next(iter(devices))
        # On the CPU the same pages are kept and copied (host to host): pointless for memory, but the
        # order of steps and their results are those of a GPU run, which is what CPU tests check.
        self.cuda = self.device.type == "cuda"
        self.group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.pages: list[_Page] = []
        self.page_of: dict[int, _Page] = {}
        self.pending: list[nn.Parameter] = []  # first step: weights with a gradient, not yet in a page
        self.stepped: set[int] = set()  # weights stepped since the last optimizer.step()
        self.callback_queued = False
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = {"pages_stepped": 0, "h2d_bytes": 0, "d2h_bytes": 0, "late_copies_in": 0}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.handles += [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
                         optimizer.register_load_state_dict_post_hook(self._after_load)]

    # --- backward ---------------------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if id(p) in self.stepped:
            raise RuntimeError("a weight got a second gradient before optimizer.step() (a second backward, or a "
                               "weight two checkpointed blocks use): StepInBackward steps each weight once its "
                               "gradient arrives, so it needs exactly one gradient per weight and step")
        if not self.callback_queued:  # runs once this backward has ended
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True
        page = self.page_of.get(id(p))
        if page is None:  # first step (or a weight that had no gradient then): pages form as they come
            self.pending.append(p)
            if sum(q.nbytes for q in self.pending) >= self.page_bytes:
                self._step(self._new_page())
            return
        if not page.ready:
            for nxt in self.pages[page.index:page.index + 1 + self.ahead]:
                self._page_in(nxt)
        page.ready.add(id(p))
        if len(page.ready) == len(page.params):
            self._step(page)

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        if self.pending:
            self._step(self._new_page())
        for page in self.pages:
            if page.ready:  # some of its weights got no gradient this time
                self._step(page)
            elif page.on_device is not None:  # prefetched, but none of its weights got one
                self._page_out(page)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.stepped.clear()  # a step closes the cycle; the weights' gradients are gone already

    # --- a page's step ------------------------------------------------------------------------------
    def _new_page(self) -> _Page:
        page = _Page(len(self.pages), self.pending)
        self.pending = []
        self.pages.append(page)
        for p in page.params:
            self.page_of[id(p)] = page
        page.groups = sorted({self.group_of[id(p)] for p in page.params})
        groups = [{**self.optimizer.param_groups[gi], "params": [p for p in page.params if self.group_of[id(p)] == gi]}
                  for gi in page.groups]
        page.sub = sub_optimizer(self.optimizer, groups)
        page.sub.state = self.optimizer.state  # the real weights: one state, one state_dict() (set again at each step)
        page.ready = {id(p) for p in page.params}
        return page

    def _step(self, page: _Page) -> None:
        self._page_in(page)
        if page.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(page.arrived)
        page.sub.state = self.optimizer.state  # load_state_dict() replaces the user's state dict
        for sub_group, gi in zip(page.sub.param_groups, page.groups):  # e.g. the scheduler's latest lr
            sub_group.update({k: v for k, v in self.optimizer.param_groups[gi].items() if k != "params"})
        page.sub.step()
        for p in page.params:
            if id(p) in page.ready:
                p.grad = None  # stepped: the gradient's memory goes back now, not after backward
                self.stepped.add(id(p))
        page.ready = set()
        self._page_out(page)
        self.stats["pages_stepped"] += 1

    def _page_in(self, page: _Page) -> None:
        if page.on_device is not None or page.arena is None:
            return  # paged in already, or it has no state yet (its first step creates it)
        if page.ready:  # its gradients are arriving and it was not prefetched
            self.stats["late_copies_in"] += 1
        on_device = torch.empty(page.arena.nbytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream(self.device))  # its memory may be in use until here
            if page.copied_out is not None:
                self.h2d.wait_event(page.copied_out)
        with self._on(self.h2d):
            on_device.copy_(page.arena.buffer[:page.arena.nbytes], non_blocking=True)
            if self.cuda:
                page.arrived = self.h2d.record_event()
                on_device.record_stream(self.h2d)
        for p, key, offset, home in page.layout:
            self.optimizer.state[p][key] = typed_view(on_device, offset, home.dtype, home.shape)
        page.on_device = on_device
        self.stats["h2d_bytes"] += page.arena.nbytes

    def _page_out(self, page: _Page) -> None:
        if page.arena is None:
            self._make_home(page)
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # after the step wrote the state
        with self._on(self.d2h):
            base = page.on_device.data_ptr() if page.on_device is not None else None
            if base is not None and all(self.optimizer.state[p][k].data_ptr() == base + off
                                        for p, k, off, _ in page.layout):
                page.arena.buffer[:page.arena.nbytes].copy_(page.on_device, non_blocking=True)
                written = [page.on_device]
            else:  # state the optimizer just made (or replaced): tensor by tensor
                written = [self.optimizer.state[p][key] for p, key, _, _ in page.layout]
                for (_, _, _, home), value in zip(page.layout, written):
                    home.copy_(value, non_blocking=True)
            if self.cuda:
                for tensor in written:
                    tensor.record_stream(self.d2h)  # its memory is reused only once the copy has read it
                page.copied_out = self.d2h.record_event()
        for p, key, _, home in page.layout:
            self.optimizer.state[p][key] = home
        page.on_device = None
        self.stats["d2h_bytes"] += page.arena.nbytes

    def _make_home(self, page: _Page) -> None:
        """The page's state tensors (not scalars such as AdamW's ``step``), laid out in one pinned arena."""
        entries, total = [], 0
        for p in page.params:
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.device == self.device and value.numel() > 1:
                    entries.append((p, key, total, value))
                    total = align_up(total + value.nbytes)
        page.arena = HostArena(total)
        if self.cuda:
            page.arena.pin()
        page.layout = [(p, key, off, typed_view(page.arena.buffer, off, v.dtype, v.shape))
                       for p, key, off, v in entries]

    def _after_load(self, optimizer) -> None:
        """``load_state_dict`` replaced the state (on the weights' device): into the pages' homes, so
        the next copy in brings the loaded values, not the ones from before."""
        for page in self.pages:
            page.on_device = None
            if all(key in optimizer.state.get(p, {}) for p, key, _, _ in page.layout):
                self._page_out(page)
            else:  # the checkpoint holds other state for it: its next step lays it out again
                page.arena, page.layout, page.copied_out = None, [], None
        self.wait()

    # --- the rest -----------------------------------------------------------------------------------
    def _on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    def wait(self) -> None:
        """Block until every page's copy out has landed (before the host reads the state)."""
        if self.cuda:
            self.d2h.synchronize()

    def remove(self) -> None:
        self.wait()
        for handle in self.handles:
            handle.remove()
