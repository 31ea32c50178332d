"""Some units' optimizer steps on the GPU during backward, while the CPU steps the rest.

With optimizer offload (``bind_optimizer(overlap_backward=True)``) every unit's AdamW step runs on
the host worker, and a step takes as long as that worker needs for all of them, even though the GPU
sits idle for most of it (the toy of ``bench/offload.py``: 12 ms of GPU work in a 58 ms step).  A
*device unit* steps on the GPU instead, the moment backward has produced its gradients, with its
state paged through pinned host memory (as DeepSpeed's ZeRO-Offload "Twin-Flow" splits the
optimizer between the two, except that here the GPU part keeps nothing on the GPU between steps):

- when backward reaches a device unit (or ``ahead`` units before it), its optimizer state is copied
  in from the host, on a side stream, as one buffer;
- when its last gradient arrives, its weights (still in their device slot) are copied into a
  private buffer on the compute stream (so no later load into the slot can overwrite them first),
  and on the side stream the user's optimizer class steps them there; the new weights go out to
  their host masters and the state back to the host, on the same stream.  No gradient leaves the
  GPU;
- the next forward loads the unit from its master once those copies have landed (the manager
  waits for the unit's step as it does for the worker's).

The device units are the units the next forward runs first: their steps are done before the
worker has even started the others, so the forward starts at once, and the worker's share shrinks
by theirs.  PCIe carries, per device unit, the state in and weights + state out (4 weights' bytes
instead of the gradients' 1); memory holds a unit's state, weights and gradients while it steps.

The host copy of the state is the one the user's optimizer holds (``optimizer.state[param]``, in
pinned host tensors): ``state_dict()``, checkpoints and resume see one optimizer, and a device
unit that ran twice in a forward (its gradient may come in pieces) steps on the worker instead, on
the same host state.  The device's fused AdamW kernel is not the CPU's: results agree to rounding,
not bitwise (on a CPU run the "device" step is the same CPU kernel: bitwise, which is what CPU
tests check).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .arena import HostArena, host_copies, release_all, typed_view
from .grads import blocking_event
from .host_optimizer import groups_over, sub_optimizer
from .optimizer_state import _on


class _UnitState:
    """One unit's optimizer state in a host arena: ``layout`` = (param index, key, offset, home view)."""

    def __init__(self, arena: HostArena, layout: list[tuple[int, str, int, torch.Tensor]]):
        self.arena, self.layout = arena, layout
        self.on_device: dict[tuple[int, str], torch.Tensor] | None = None
        self.arrived = None  # event: the copy in landed
        self.copied_out = None  # event: the last copy out landed (the next copy in reads it)


class DeviceSteps:
    """Steps ``units`` (index -> [(real parameter, host master)]) on ``device``; ``forward_order``:
    every unit's index in the order the forward runs them.

    ``on_grad(unit, param, grad)``: a device gradient of one of ``unit``'s weights arrived (the
    unit steps once all its weights have theirs);
    ``backward_use(unit)``: backward reached ``unit`` (page in the state of what steps next);
    ``flush()``: after backward, step units some of whose weights got no gradient.  The events of
    each unit's copies out are handed to ``track(unit, event)`` (``HostStepper.track``), which the
    manager waits on before loading the unit again.  ``stats``: units stepped, bytes each way,
    state copies in that were not prefetched."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: dict[int, list[tuple[nn.Parameter, torch.Tensor]]],
                 forward_order: list[int], device: torch.device, track, ahead: int = 2):
        self.optimizer, self.device, self.track, self.ahead = optimizer, device, track, ahead
        self.cuda = device.type == "cuda"
        self.units = units
        self.forward_order = forward_order  # every unit's index; backward meets them in reverse
        self.position = {u: i for i, u in enumerate(forward_order)}
        self.group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.index_of = {id(real): i for pairs in units.values() for i, (real, _) in enumerate(pairs)}
        self.state: dict[int, _UnitState] = {}
        self.grads: dict[int, dict[int, torch.Tensor]] = {}  # unit -> param index -> device gradient
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # steps and copies out
        self.h2d = torch.cuda.Stream(device) if self.cuda else None  # state in
        self.stats = {"units_stepped": 0, "h2d_bytes": 0, "d2h_bytes": 0, "late_state_in": 0}
        self._arenas: list[HostArena] = []
        weakref.finalize(self, release_all, self._arenas)

    # --- backward ---------------------------------------------------------------------------------
    def backward_use(self, unit: int) -> None:
        """Backward is about to run ``unit``: bring in the state of the device units among it and
        the ``ahead`` units backward runs after it (the ones before it in forward order)."""
        pos = self.position.get(unit)
        if pos is not None:
            for u in self.forward_order[max(0, pos - self.ahead):pos + 1]:
                if u in self.units:
                    self._page_in(u)

    def on_grad(self, unit: int, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.grads.setdefault(unit, {})[self.index_of[id(param)]] = grad
        if len(self.grads[unit]) == len(self.units[unit]):
            self._step(unit)

    def flush(self) -> None:
        for unit in list(self.grads):
            self._step(unit)

    # --- the step ---------------------------------------------------------------------------------
    def _page_in(self, unit: int) -> None:
        state = self.state.get(unit) or self._adopt(unit)
        if state is None or state.on_device is not None:
            return  # no state yet (its first step makes it), or in already
        self._adopt_replaced(unit, state)
        with _on(self.h2d):  # made on this stream: its memory waits for no other stream's work
            buf = torch.empty(state.arena.nbytes, dtype=torch.uint8, device=self.device)
            if self.cuda and state.copied_out is not None:
                self.h2d.wait_event(state.copied_out)  # the last copy out writes what we read
            buf.copy_(state.arena.buffer[:state.arena.nbytes], non_blocking=True)
            if self.cuda:
                state.arrived = self.h2d.record_event()
                buf.record_stream(self.stream)
        state.on_device = {(i, key): typed_view(buf, off, home.dtype, home.shape) for i, key, off, home in state.layout}
        self.stats["h2d_bytes"] += state.arena.nbytes

    def _adopt(self, unit: int) -> _UnitState | None:
        """State the user's optimizer holds already (a resume's ``load_state_dict``, or a step the
        worker took): it moves into a pinned host arena of the unit's, which the optimizer then holds."""
        entries = [(i, key, value) for i, (real, _) in enumerate(self.units[unit])
                   for key, value in self.optimizer.state.get(real, {}).items() if isinstance(value, torch.Tensor)]
        if not entries:
            return None
        state = self._home(unit, entries)
        for (_, _, value), (_, _, _, home) in zip(entries, state.layout):
            home.copy_(value)
        return state

    def _home(self, unit: int, entries: list[tuple[int, str, torch.Tensor]]) -> _UnitState:
        """A pinned host arena shaped like ``entries`` ((param index, key, tensor)), held from now on
        by the user's ``optimizer.state`` (filled by the caller)."""
        arena, views = host_copies([value for _, _, value in entries], pin=self.cuda)
        self._arenas.append(arena)
        old = self.state.get(unit)
        state = _UnitState(arena, [(i, key, off, home) for (i, key, _), (off, home) in zip(entries, views)])
        if old is not None:
            state.copied_out = old.copied_out
        self.state[unit] = state
        for i, key, _, home in state.layout:
            self.optimizer.state.setdefault(self.units[unit][i][0], {})[key] = home
        return state

    def _adopt_replaced(self, unit: int, state: _UnitState) -> None:
        """``load_state_dict`` replaces the user's state tensors: copy their values home first."""
        pairs = self.units[unit]
        for i, key, _, home in state.layout:
            value = self.optimizer.state.get(pairs[i][0], {}).get(key)
            if value is not None and value is not home:
                home.copy_(value)
                self.optimizer.state[pairs[i][0]][key] = home

    def _step(self, unit: int) -> None:
        grads = self.grads.pop(unit)
        pairs = self.units[unit]
        state = self.state.get(unit)
        if state is None or state.on_device is None:
            self._page_in(unit)
            if self.state.get(unit) is not None:
                state = self.state[unit]
                self.stats["late_state_in"] += 1
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        # the weights leave the slot on the compute stream: a later load into it waits for that stream.
        # (A unit already evicted points at its master again: same values, copied in.)
        weights = [real.detach().clone() if real.device == self.device else
                   torch.empty_like(master, device=self.device).copy_(master, non_blocking=True)
                   for real, master in pairs]
        stand_ins = [nn.Parameter(w) for w in weights]
        for i, s in enumerate(stand_ins):
            s.grad = grads.get(i)
        groups, _ = groups_over(self.optimizer, self.group_of, [real for real, _ in pairs], stand_ins)
        sub = sub_optimizer(self.optimizer, groups)
        if state is not None:
            for i, key, _, _ in state.layout:
                sub.state[stand_ins[i]][key] = state.on_device[(i, key)]
        if self.cuda:
            self.stream.wait_stream(compute)  # the gradients and the weights' copy
            if state is not None and state.arrived is not None:
                self.stream.wait_event(state.arrived)
        with _on(self.stream):
            sub.step()
            if state is None or not self._in_place(sub, stand_ins, state):
                state = self._new_home(unit, sub, stand_ins)
            self._copy_out(unit, weights, state)
            if self.cuda:  # memory made on other streams, freed once this stream has used it
                for t in [*weights, *(g for g in grads.values())]:
                    t.record_stream(self.stream)
        self.stats["units_stepped"] += 1

    def _in_place(self, sub, stand_ins, state: _UnitState) -> bool:
        """The optimizer updated the paged-in views and made no other state."""
        made = {(i, key) for i, s in enumerate(stand_ins) for key in sub.state.get(s, {})}
        return made == set(state.on_device) and all(
            sub.state[stand_ins[i]][key] is view for (i, key), view in state.on_device.items())

    def _new_home(self, unit: int, sub, stand_ins) -> _UnitState:
        """First step (or state of another shape): a home for the state the device step made."""
        entries = [(i, key, value) for i, s in enumerate(stand_ins) for key, value in sub.state.get(s, {}).items()
                   if isinstance(value, torch.Tensor)]
        state = self._home(unit, entries)
        state.on_device = {(i, key): value for i, key, value in entries}
        return state

    def _copy_out(self, unit: int, weights: list[torch.Tensor], state: _UnitState) -> None:
        """On the current (side) stream: the new weights to their masters, the state home."""
        for w, (_, master) in zip(weights, self.units[unit]):
            master.copy_(w, non_blocking=True)
            self.stats["d2h_bytes"] += w.nbytes
        for i, key, _, home in state.layout:
            value = state.on_device[(i, key)]
            home.copy_(value, non_blocking=True)
            if self.cuda:
                value.record_stream(self.stream)
            self.stats["d2h_bytes"] += value.nbytes
        state.on_device = None
        event = blocking_event(self.stream) if self.cuda else None
        state.copied_out = event
        self.track(unit, event)

    def close(self) -> None:
        if self.cuda:
            self.stream.synchronize()
