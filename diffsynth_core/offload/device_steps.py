"""Some units' optimizer steps on the GPU during backward, while the CPU steps the rest.

With optimizer offload (``bind_optimizer(overlap_backward=True)``) every unit's AdamW step runs on
the host worker, and a step takes as long as that worker needs for all of them, even though the GPU
sits idle for most of it (the toy of ``bench/offload.py``: 12 ms of GPU work in a 58 ms step).  A
*device unit* steps on the GPU instead, the moment backward has produced its gradients, with its
state paged through pinned host memory (as DeepSpeed's ZeRO-Offload "Twin-Flow" splits the
optimizer between the two, except that here the GPU part keeps nothing on the GPU between steps):

- when backward reaches a device unit (or ``ahead`` units before it), its optimizer state is copied
  in from the host, on a side stream, as one buffer (a ``StatePage`` per unit);
- when its last gradient arrives, its weights (still in their device slot) are copied into a
  private buffer on the compute stream (so no later load into the slot can overwrite them first),
  and on the side stream the worker's sub-optimizer of the unit steps them there; the new weights
  go out to their host masters and the state back to the host, on the same stream.  No gradient
  leaves the GPU;
- the next forward loads the unit from its master once those copies have landed (the manager
  waits for the unit's step as it does for the worker's).

The device units are the units the next forward runs first: their steps are done before the
worker has even started the others, so the forward starts at once, and the worker's share shrinks
by theirs.  PCIe carries, per device unit, the state in and weights + state out (4 weights' bytes
instead of the gradients' 1); memory holds a unit's state, weights and gradients while it steps.

The host copy of the state is the one the user's optimizer holds (``optimizer.state[param]``, in
pinned host tensors, pointed at the device copy only while the unit steps): ``state_dict()``,
checkpoints and resume see one optimizer.  A device unit that ran twice in a forward (its gradient
may come in pieces) steps on the worker instead, on the host state: only units that stepped here
before have a page and are brought in ahead, and a page that came in but did not step goes back
untouched.  The device's fused AdamW kernel is not the CPU's: results agree to rounding, not
bitwise (on a CPU run the "device" step is the same CPU kernel: bitwise, which is what CPU tests
check).

With ``keep_state=True`` a device unit's state is not paged: it stays on the device between steps
(its bytes of device memory for good; DeepSpeed's Twin-Flow keeps its GPU share there too), so
PCIe carries only the weights out, the same bytes as a host unit's gradients.  State that is not
on the device (made by the worker, or loaded by a resume's ``load_state_dict``) moves there at the
unit's next step here, and back to the host when the worker steps the unit instead (a unit run
twice in a forward).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .arena import HostArena, release_all
from .grads import blocking_event
from .optimizer_state import StatePage, _on


class DeviceSteps:
    """Steps ``units`` (index -> [(real parameter, host master)]) on ``device``; ``forward_order``:
    every unit's index in the order the forward runs them; ``stepper``: the manager's
    ``HostStepper``, whose per-unit sub-optimizers step here too.

    ``on_grad(unit, param, grad)``: a device gradient of one of ``unit``'s weights arrived (the
    unit steps once all its weights have theirs);
    ``backward_use(unit)``: backward reached ``unit`` (page in the state of what steps next);
    ``flush()``: after backward, step units some of whose weights got no gradient, and send back
    the state that came in for units the worker steps this time (untouched).  The events of
    each unit's copies out are handed to ``stepper.track(unit, event)``, which the manager waits on before
    loading the unit again.  ``stats``: units stepped, bytes each way, state copies in that were
    not prefetched.  ``keep_state``: the units' state stays on the device (see above)."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: dict[int, list[tuple[nn.Parameter, torch.Tensor]]],
                 forward_order: list[int], device: torch.device, stepper, ahead: int = 2, keep_state: bool = False):
        self.optimizer, self.device, self.stepper, self.ahead = optimizer, device, stepper, ahead
        self.keep_state = keep_state
        self.cuda = device.type == "cuda"
        self.units = units
        self.forward_order = forward_order  # every unit's index; backward meets them in reverse
        self.position = {u: i for i, u in enumerate(forward_order)}
        self.index_of = {id(real): i for pairs in units.values() for i, (real, _) in enumerate(pairs)}
        self.pages: dict[int, StatePage] = {}  # unit -> its state's host page (after its first step here)
        self.grads: dict[int, dict[int, torch.Tensor]] = {}  # unit -> param index -> device gradient
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # steps and copies out
        self.h2d = torch.cuda.Stream(device) if self.cuda else None  # state in
        self.stats = {"units_stepped": 0, "h2d_bytes": 0, "d2h_bytes": 0, "late_state_in": 0}
        self._arenas: list[HostArena] = []
        weakref.finalize(self, release_all, self._arenas)

    # --- backward ---------------------------------------------------------------------------------
    def backward_use(self, unit: int) -> None:
        """Backward is about to run ``unit``: bring in the state of the device units among it and
        the ``ahead`` units backward runs after it (the ones before it in forward order).  Only
        units with a page: a unit the worker steps (one that ran twice a forward) must keep its
        state on the host."""
        pos = self.position.get(unit)
        if pos is not None and not self.keep_state:
            for u in self.forward_order[max(0, pos - self.ahead):pos + 1]:
                if u in self.pages:
                    self._page_in(u)

    def on_grad(self, unit: int, param: nn.Parameter, grad: torch.Tensor) -> None:
        self.grads.setdefault(unit, {})[self.index_of[id(param)]] = grad
        if len(self.grads[unit]) == len(self.units[unit]):
            self._step(unit)

    def flush(self) -> None:
        for unit in list(self.grads):
            self._step(unit)
        for page in self.pages.values():  # came in, but the unit stepped on the worker (or not at all)
            if page.on_device is not None:
                page.put_back()

    # --- the state --------------------------------------------------------------------------------
    def _move_state(self, unit: int, device: torch.device) -> int:
        """``keep_state``: the unit's state tensors not on ``device`` are moved there (the
        optimizer's entries replaced); the bytes moved."""
        moved = 0
        for p, key, value in self._entries(unit):
            if value.device != device:
                self.optimizer.state[p][key] = value.to(device)
                moved += value.nbytes
        return moved

    def before_host_step(self, unit: int) -> None:
        """The worker is about to step ``unit`` (it ran twice in a forward): with ``keep_state``,
        its state comes back to the host first (the CPU step cannot read device state)."""
        if self.keep_state and unit in self.units:
            if self.cuda:
                self.stream.synchronize()  # its last step here wrote that state
            self.stats["d2h_bytes"] += self._move_state(unit, torch.device("cpu"))

    def _page_in(self, unit: int) -> bool:
        """The unit's state onto the device (False: in already, or none yet: its first step makes it)."""
        page = self.pages.get(unit)
        if page is not None and page.on_device is not None:
            return False
        page = self._adopt(unit)  # only here: while in, the entries point at the device, not home
        if page is None:
            return False
        with _on(self.h2d):  # made on this stream: its memory waits for no other stream's work
            nbytes = page.copy_in(self.h2d)
        if nbytes and self.cuda:
            page.on_device.record_stream(self.stream)  # the step reads and writes it there
        self.stats["h2d_bytes"] += nbytes
        return nbytes > 0

    def _adopt(self, unit: int) -> StatePage | None:
        """The unit's page, holding the state the user's optimizer holds now: new tensors (made by
        the worker, or by a resume's ``load_state_dict``) are copied home, and the optimizer points there."""
        entries = self._entries(unit)
        page = self.pages.get(unit)
        if page is not None and all(page.homes.get((id(p), k)) is v for p, k, v in entries):
            return page  # the usual case: nothing replaced
        page = self._page_for(unit, entries)
        if page is not None and page.copied_out is not None:
            page.copied_out.synchronize()  # its last copy out writes the homes
        for p, k, v in entries:
            home = page.homes[(id(p), k)]
            if v is not home:
                home.copy_(v)
                self.optimizer.state[p][k] = home
        return page

    def _entries(self, unit: int) -> list[tuple[nn.Parameter, str, torch.Tensor]]:
        """The unit's state tensors, scalars included (AdamW's fused ``step`` is on the weight's device)."""
        state = self.optimizer.state
        return [(real, key, value) for real, _ in self.units[unit]
                for key, value in state.get(real, {}).items() if isinstance(value, torch.Tensor)]

    def _page_for(self, unit: int, entries) -> StatePage | None:
        """The unit's page if every entry has a home of its shape and dtype there, else a new one
        laid out over ``entries`` (none for no entries)."""
        page = self.pages.get(unit)
        if entries and (page is None or not all(
                (home := page.homes.get((id(p), k))) is not None and home.shape == v.shape and home.dtype == v.dtype
                for p, k, v in entries)):
            page = self.pages[unit] = StatePage(self.optimizer, entries, self.device)
            self._arenas.append(page.arena)
        return page

    # --- the step ---------------------------------------------------------------------------------
    def _step(self, unit: int) -> None:
        grads = self.grads.pop(unit)
        if self.keep_state:  # on the compute stream, which the step's stream waits for below
            self.stats["h2d_bytes"] += self._move_state(unit, self.device)
        elif self._page_in(unit):
            self.stats["late_state_in"] += 1
        page = self.pages.get(unit)
        pairs = self.units[unit]
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        # the weights leave the slot on the compute stream: a later load into it waits for that stream.
        # (A unit already evicted points at its master again: same values, copied in.)
        weights = [real.detach().clone() if real.device == self.device else
                   torch.empty_like(master, device=self.device).copy_(master, non_blocking=True)
                   for real, master in pairs]
        if self.cuda:
            self.stream.wait_stream(compute)  # the gradients and the weights' copy
            if page is not None and page.arrived is not None:
                self.stream.wait_event(page.arrived)
        with _on(self.stream):
            self._sub_step(unit, weights, grads)
            self._copy_out(unit, weights)
            if self.cuda:  # memory made on other streams, freed once this stream has used it
                for t in [*weights, *grads.values()]:
                    t.record_stream(self.stream)
        self.stats["units_stepped"] += 1

    def _sub_step(self, unit: int, weights: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> None:
        """The worker's sub-optimizer of ``unit``, its stand-ins pointed at ``weights`` for the step
        (the worker never steps this unit meanwhile: the forward waited for its last step)."""
        sub, stand_ins = self.stepper.sub_for(unit)
        for i, (s, w) in enumerate(zip(stand_ins, weights)):
            s.data, s.grad = w, grads.get(i)
        try:
            sub.step()
        finally:
            for s, (_, master) in zip(stand_ins, self.units[unit]):
                s.grad = None
                s.data = master

    def _copy_out(self, unit: int, weights: list[torch.Tensor]) -> None:
        """On the current (side) stream: the new weights to their masters, the state home (into a
        page laid out first when the step made the state, or state of another layout)."""
        for w, (_, master) in zip(weights, self.units[unit]):
            master.copy_(w, non_blocking=True)
            self.stats["d2h_bytes"] += w.nbytes
        if self.keep_state:
            self.stepper.track(unit, blocking_event(self.stream) if self.cuda else None)
            return
        page = self.pages.get(unit)
        in_place = page is not None and page.in_place()
        if not in_place:
            page = self._page_for(unit, self._entries(unit))
        if page is not None:
            self.stats["d2h_bytes"] += page.copy_out(self.stream, in_place)
        event = blocking_event(self.stream) if self.cuda else None
        self.stepper.track(unit, event)

    def close(self) -> None:
        if self.cuda:
            self.stream.synchronize()

