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
(no gradient accumulation: a second backward raises), no gradient clipping, one process (no
gradient averaging between ranks).  A step cannot be skipped as a whole over a non-finite gradient
(weights have moved before backward ends); with ``skip_nonfinite`` each *page* skips instead: its
fused optimizer reads a flag on the device (the ``found_inf`` that ``GradScaler`` uses), set when the
page's gradients or the loss given to :meth:`watch_loss` hold NaN/Inf, so no weight or state turns
non-finite and nothing waits for the host.  The Trainer uses it that way under
``offload.optimizer_step_in_backward`` (the config refuses clipping and accumulation with it).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .arena import HostArena, release_all
from .host_optimizer import groups_over, sub_optimizer
from .optimizer_state import StatePage, moves_to_host


class _Page:
    """Weights stepped together, and where their state lives between steps."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index, self.params = index, params
        self.sub: torch.optim.Optimizer | None = None
        self.groups: list[int] = []  # the user's group of each of sub's groups
        self.state: StatePage | None = None  # where its optimizer state lives between steps (after its first)
        self.ready: set[int] = set()  # ids of the weights whose gradient arrived in this backward


class StepInBackward:
    """Steps ``optimizer`` page by page during backward; see the module docstring.
    ``stats``: pages stepped, bytes of state copied each way, copies in that were not prefetched."""

    def __init__(self, optimizer: torch.optim.Optimizer, page_bytes: int = 8 * 2**20, ahead: int = 2,
                 skip_nonfinite: bool = False):
        self.optimizer, self.page_bytes, self.ahead = optimizer, page_bytes, ahead
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"StepInBackward needs every trainable weight on one device, got {devices}")
        self.device = next(iter(devices))
        if skip_nonfinite and not all(g.get("fused") for g in optimizer.param_groups):
            # only torch's fused kernels (Adam, AdamW, SGD) read found_inf; the others refuse it
            raise ValueError(f"StepInBackward(skip_nonfinite=True) needs a fused optimizer (torch.optim.Adam, AdamW or "
                             f"SGD with fused=True), got {type(optimizer).__name__} without fused")
        self.skip_nonfinite = skip_nonfinite
        self.loss_bad: torch.Tensor | None = None  # 1.0 when the watched loss is NaN/Inf (device tensor)
        self.skipped = torch.zeros((), device=self.device)  # pages skipped over NaN/Inf since take_skipped()
        # On the CPU the same pages are kept and copied (host to host): pointless for memory, but the
        # order of steps and their results are those of a GPU run, which is what CPU tests check.
        self.cuda = self.device.type == "cuda"
        self.group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.pages: list[_Page] = []
        self.page_of: dict[int, _Page] = {}
        self.pending: list[nn.Parameter] = []  # first step: weights with a gradient, not yet in a page
        self.pending_bytes = 0
        self.stepped: set[int] = set()  # weights stepped since the last optimizer.step()
        self.callback_queued = False
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = {"pages_stepped": 0, "h2d_bytes": 0, "d2h_bytes": 0, "late_copies_in": 0}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.handles += [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
                         optimizer.register_load_state_dict_post_hook(self._after_load)]
        self._arenas: list[HostArena] = []  # every page's, for the finalizer to unpin
        weakref.finalize(self, release_all, self._arenas)
        # State loaded for weights that have no page of their own yet (a resume: pages form in the
        # first step, in the gradients' order): it waits on the host here, each weight's brought in
        # for the step of the page it lands in, so the first step's peak is that of any other.
        self.loaded: StatePage | None = None
        self.loaded_left = 0  # its entries not yet brought in

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
            self.pending_bytes += p.nbytes
            if self.pending_bytes >= self.page_bytes:
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
            elif page.state is not None and page.state.on_device is not None:  # prefetched, and none got one
                self._page_out(page)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.stepped.clear()  # a step closes the cycle; the weights' gradients are gone already

    # --- a page's step ------------------------------------------------------------------------------
    def _new_page(self) -> _Page:
        page = _Page(len(self.pages), self.pending)
        self.pending, self.pending_bytes = [], 0
        self.pages.append(page)
        for p in page.params:
            self.page_of[id(p)] = page
        groups, page.groups = groups_over(self.optimizer, self.group_of, page.params, page.params)
        page.sub = sub_optimizer(self.optimizer, groups)
        page.sub.state = self.optimizer.state  # the real weights: one state, one state_dict() (set again at each step)
        page.ready = {id(p) for p in page.params}
        return page

    def _step(self, page: _Page) -> None:
        self._page_in(page)
        if page.state is None and self.loaded is not None:
            self._bring_loaded(page)
        if page.state is not None and page.state.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(page.state.arrived)
        page.sub.state = self.optimizer.state  # load_state_dict() replaces the user's state dict
        for sub_group, gi in zip(page.sub.param_groups, page.groups):  # e.g. the scheduler's latest lr
            sub_group.update({k: v for k, v in self.optimizer.param_groups[gi].items() if k != "params"})
        if self.skip_nonfinite:
            page.sub.found_inf = self._nonfinite(page)
            self.skipped += page.sub.found_inf
        page.sub.step()
        for p in page.params:
            if id(p) in page.ready:
                p.grad = None  # stepped: the gradient's memory goes back now, not after backward
                self.stepped.add(id(p))
        page.ready = set()
        self._page_out(page)
        self.stats["pages_stepped"] += 1

    def _nonfinite(self, page: _Page) -> torch.Tensor:
        """1.0 (on the device, no sync) when the page's gradients or the watched loss hold NaN/Inf.
        The gradients' norms overflow to Inf only where the Trainer's norm over all of them would too."""
        grads = [p.grad for p in page.params if id(p) in page.ready and p.grad is not None]
        bad = torch.stack(torch._foreach_norm(grads)).isfinite().all().logical_not().float() if grads else \
            torch.zeros((), device=self.device)
        return bad if self.loss_bad is None else torch.maximum(bad, self.loss_bad)

    def watch_loss(self, loss: torch.Tensor) -> None:
        """Before ``loss.backward()``: with ``skip_nonfinite``, a NaN/Inf ``loss`` skips every page this
        backward, as a whole step is skipped over one (some gradients may still come out finite)."""
        self.loss_bad = loss.detach().isfinite().logical_not().float().reshape(())

    def take_skipped(self) -> int:
        """Pages skipped over NaN/Inf since the last call (waits for the device: once a step)."""
        skipped = int(self.skipped.item())
        self.skipped.zero_()
        self.loss_bad = None
        return skipped

    def _page_in(self, page: _Page) -> None:
        """Its state onto the device on the copy-in stream (nothing before its first step made any)."""
        if page.state is None or page.state.on_device is not None:
            return
        if page.ready:  # its gradients are arriving and it was not prefetched
            self.stats["late_copies_in"] += 1
        self.stats["h2d_bytes"] += page.state.copy_in(self.h2d)

    def _page_out(self, page: _Page) -> None:
        if page.state is None:  # its first step made the state: lay it out in an arena of its own
            entries = [(p, key, value) for p in page.params for key, value in self.optimizer.state.get(p, {}).items()
                       if moves_to_host(key, value, p)]
            if not entries:
                return
            page.state = StatePage(self.optimizer, entries)
            self._arenas.append(page.state.arena)
        self.stats["d2h_bytes"] += page.state.copy_out(self.d2h)

    def _after_load(self, optimizer) -> None:
        """``load_state_dict`` replaced the state (on the weights' device): into the pages' homes, so
        the next copy in brings the loaded values, not the ones from before; the rest (weights with
        no laid-out page yet) into ``loaded``."""
        dropped = []
        for page in self.pages:
            if page.state is None:
                continue
            page.state.on_device = None
            if all(key in optimizer.state.get(p, {}) for p, key, _, _ in page.state.layout):
                self._page_out(page)
            else:  # the checkpoint holds other state for it: its next step lays it out again
                dropped.append(page.state.arena)
                page.state = None
        if dropped and self.cuda:
            torch.cuda.synchronize(self.device)  # no copy either way still uses their arenas
        for arena in dropped:
            self._drop_arena(arena)
        laid_out = {id(p) for page in self.pages if page.state is not None for p in page.params}
        entries = [(p, key, value) for p in self.params if id(p) not in laid_out
                   for key, value in optimizer.state.get(p, {}).items() if moves_to_host(key, value, p)]
        self._release_loaded()
        if entries:
            self.loaded, self.loaded_left = StatePage(optimizer, entries), len(entries)
            self._arenas.append(self.loaded.arena)
            self.loaded.copy_out(self.d2h)
        self.wait()

    def _bring_loaded(self, page: _Page) -> None:
        """The loaded state of a page's weights onto the device, for its first step (which then lays
        it out in the page's own arena); on the compute stream: once, and small."""
        state, homes = self.optimizer.state, self.loaded.homes
        for p in page.params:
            for key, value in state.get(p, {}).items():
                if homes.get((id(p), key)) is value:
                    state[p][key] = value.to(self.device, non_blocking=True, copy=True)
                    self.stats["h2d_bytes"] += value.nbytes
                    self.loaded_left -= 1
        if not self.loaded_left:
            self._release_loaded()  # every entry has moved on to its page

    def _release_loaded(self) -> None:
        if self.loaded is None:
            return
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # the copies in have read it
        self._drop_arena(self.loaded.arena)
        self.loaded = None

    def _drop_arena(self, arena: HostArena) -> None:
        """Unpin an arena no entry points at any more, now rather than when the pager goes."""
        self._arenas.remove(arena)
        arena.release()

    # --- the rest -----------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every page's copy out has landed (before the host reads the state)."""
        if self.cuda:
            self.d2h.synchronize()

    def remove(self) -> None:
        self.wait()
        for handle in self.handles:
            handle.remove()
