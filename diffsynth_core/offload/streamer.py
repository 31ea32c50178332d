"""Device slots and the copy engine: one host->device copy per unit, on a side stream, ordered by events.

A slot is a preallocated device buffer big enough for the largest unit; a unit is *loaded* when its
parameters' ``.data`` point into a slot and *evicted* when they point back at their host master
(a pointer swap: frozen weights never travel device->host).

Every streamed unit has a fixed *home* slot (round robin over the execution order), and is only
ever loaded there.  That is what makes training without gradient checkpointing correct: autograd saves views of
weights (``weight.t()`` inside ``F.linear``) that keep pointing into the slot after the unit is
evicted; since the unit comes back to the same slot, at the same offsets, before its backward runs,
those views read the right bytes again.  On CUDA the copy runs on a private
stream that first waits for the slot's ``free`` event (the compute that last read the slot), and the
compute stream waits for the unit's ``ready`` event before using it.  A unit stored in another
dtype (fp8) is copied into one of two staging buffers and widened into its slot on a third stream,
so the copy engine never waits for the widening (which shares the SMs with compute).  Such a
unit's copy may also be *staged ahead* (``stage_ahead``), before its slot is free: with compact
units between streamed ones in the slot ring, the copy engine then runs as far ahead as the staging
buffers allow instead of as far as the slots do.  On a CPU
target the same code runs with synchronous copies (one staging buffer), which is what the CPU tests
exercise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .arena import typed_view
from .plan import master_view, stage_count
from .units import Unit
from .widening import UnitWidening


@dataclass
class Slot:
    index: int
    buf: torch.Tensor  # uint8, compute layout
    occupant: Unit | None = None
    free_event: object | None = None  # torch.cuda.Event recorded when the occupant was evicted
    landed: object | None = None  # when the last copy into it landed (it may never have been used)
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class Streamer:
    def __init__(self, units: list[Unit], arena, device: torch.device, n_slots: int,
                 poison_evicted: bool = False):
        """``units``: every unit (any of them may stream); slots fit the largest."""
        self.device, self.arena, self.poison = device, arena, poison_evicted
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready: dict[int, object] = {}  # unit index -> ready event (CUDA)
        self.slot_of: dict[int, Slot] = {}
        self.masters = {u.index: [master_view(arena.buffer, u, r) for r in u.tensors] for u in units}
        size = max((u.dev_bytes for u in units), default=0)
        stage = max((u.host_bytes for u in units if u.casts), default=0)
        # Units stored in another dtype (fp8) land in a staging buffer and are widened into their
        # slot.  On CUDA the widening runs on a stream of its own, so the copy engine goes on with
        # the next unit (into the other staging buffer) while SMs busy with compute delay the
        # widening; the widening is what waits for the slot to be free, not the copy.
        self.stages = [torch.empty(stage, dtype=torch.uint8, device=device)
                       for _ in range(stage_count(device) if stage else 0)]
        self.stage_free: list[object | None] = [None] * len(self.stages)  # widening done reading it
        self.next_stage = 0
        self.staged: dict[int, tuple[int, object]] = {}  # unit -> (stage, copy landed): not yet widened
        self.widen_stream = torch.cuda.Stream(device) if self.cuda and self.stages else None
        self.slots = [Slot(i, torch.empty(size, dtype=torch.uint8, device=device))
                      for i in range(n_slots if units else 0)]
        self.home = {u.index: i % max(len(self.slots), 1) for i, u in enumerate(units)}
        # Units kept on the device as stored (fp8, chosen by the budget): widened from there.
        self.stored: dict[int, torch.Tensor] = {}
        # Recorded as CUDA graphs (widening.py): packed and fp8 units alike
        self.widening = {u.index: UnitWidening(u, device, graphs=True) for u in units if u.casts}
        if self.widen_stream is not None:  # the widenings' tables were just copied on this stream
            self.widen_stream.wait_stream(torch.cuda.current_stream(device))
        self.copies = 0  # host->device copies
        self.widenings = 0  # loads widened from a device copy (no host->device copy)
        self.staged_ahead = 0  # copies started before their slot was free (``stage_ahead``)
        self.stalls = 0  # uses that found their copy still in flight (telemetry, CUDA only)
        self.bytes = 0

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].buf.numel() if self.slots else 0

    def add_slots(self, count: int) -> None:
        """``count`` more slots (the budget's plan); homes are re-dealt by the next ``rehome``."""
        self.slots += [Slot(len(self.slots), torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device))
                       for _ in range(count if self.slots else 0)]

    # --- binding -----------------------------------------------------------------------------
    def bind_host(self, unit: Unit) -> None:
        for rec, master in zip(unit.tensors, self.masters[unit.index]):
            rec.param.data = master

    def _views(self, slot: Slot, unit: Unit) -> list[torch.Tensor]:
        views = slot.views.get(unit.index)
        if views is None:
            views = [typed_view(slot.buf, r.dev_offset, r.compute_dtype, r.shape) for r in unit.tensors]
            slot.views[unit.index] = views
        return views

    # --- moves -------------------------------------------------------------------------------
    def is_loaded(self, unit: Unit) -> bool:
        return unit.index in self.slot_of

    def loaded_units(self) -> list[Unit]:
        return [s.occupant for s in self.slots if s.occupant is not None]

    def load(self, unit: Unit, slot: Slot, on_bind=None) -> None:
        """Copy ``unit`` into ``slot`` (asynchronously on CUDA) and point its parameters there."""
        assert slot.occupant is None
        views = self._views(slot, unit)
        if on_bind is not None:
            on_bind(unit)
        # Copy and widening run on different streams: the next write into the slot waits for both
        # the compute that read it and the last write, which compute may never have waited for.
        after = [e for e in (slot.free_event, slot.landed) if e is not None]
        if unit.index in self.stored:
            self.widenings += 1
        elif unit.index not in self.staged:  # a copy staged ahead was counted when it started
            self._count_copy(unit)
        self.ready[unit.index] = slot.landed = self._copy(unit, slot.buf, views, after)
        for rec, view in zip(unit.tensors, views):
            rec.param.data = view
        slot.occupant = unit
        self.slot_of[unit.index] = slot

    def _count_copy(self, unit: Unit) -> None:
        self.copies += 1
        self.bytes += unit.host_bytes

    def _copy(self, unit: Unit, buf: torch.Tensor, views: list[torch.Tensor], after=()):
        """Land ``unit`` in ``buf`` once the events ``after`` (what last used it) have passed;
        returns the event that says it has landed (CUDA; ``None`` on a CPU target, where copies
        are synchronous)."""
        stored = self.stored.get(unit.index)
        if stored is not None:  # kept on the device as stored: only the widening runs
            return self._widen_after(unit, stored, buf, views, after)
        src = self.arena.region(unit.host_offset, unit.host_bytes)
        if not unit.casts:  # identical layouts: one copy lands every tensor in place
            if not self.cuda:
                buf.narrow(0, 0, unit.host_bytes).copy_(src)
                return None
            with torch.cuda.stream(self.copy_stream):
                for event in after:
                    self.copy_stream.wait_event(event)
                buf.narrow(0, 0, unit.host_bytes).copy_(src, non_blocking=True)
                return self.copy_stream.record_event()
        i, copied = self.staged.pop(unit.index, None) or self._copy_to_stage(unit, src)
        done = self._widen_after(unit, self.stages[i].narrow(0, 0, unit.host_bytes), buf, views,
                                 [copied, *after] if copied is not None else after)
        self.stage_free[i] = done  # the next copy into this stage waits for it
        return done

    def _copy_to_stage(self, unit: Unit, src: torch.Tensor) -> tuple[int, object]:
        """Copy ``unit``'s stored bytes into a staging buffer; returns (stage, landed event; ``None``
        on a CPU target, where the copy is done on return).  A stage still holding a unit staged
        ahead is passed over while another is free; if none is, the oldest such copy is given up
        (it is copied again when needed)."""
        held = {i for i, _ in self.staged.values()}
        n = len(self.stages)
        i = next((j % n for j in range(self.next_stage, self.next_stage + n) if j % n not in held), self.next_stage)
        for k in [k for k, (j, _) in self.staged.items() if j == i]:
            del self.staged[k]
        self.next_stage = (i + 1) % n
        if not self.cuda:
            self.stages[i].narrow(0, 0, unit.host_bytes).copy_(src)
            return i, None
        with torch.cuda.stream(self.copy_stream):
            if self.stage_free[i] is not None:  # its last widening has read it
                self.copy_stream.wait_event(self.stage_free[i])
            self.stages[i].narrow(0, 0, unit.host_bytes).copy_(src, non_blocking=True)
            return i, self.copy_stream.record_event()

    def stage_ahead(self, unit: Unit) -> bool:
        """Start the host->device copy of ``unit`` (stored in another dtype, streamed) into a free
        staging buffer now, before its slot is free; its load then only widens.  ``False`` when
        there is nothing to do or no staging buffer is free.  (On a CPU target the copy is
        synchronous and gains nothing; it runs there so that the tests exercise this bookkeeping.)"""
        if (not unit.casts or unit.index in self.stored or unit.index in self.staged
                or unit.index in self.slot_of or len(self.staged) >= len(self.stages)):
            return False
        self._count_copy(unit)
        self.staged_ahead += 1
        self.staged[unit.index] = self._copy_to_stage(unit, self.arena.region(unit.host_offset, unit.host_bytes))
        return True

    def _widen_after(self, unit: Unit, src: torch.Tensor, dst: torch.Tensor, views: list[torch.Tensor], after):
        """Widen ``unit``'s stored bytes in ``src`` (a staging buffer or its device copy) into
        ``dst`` (its ``views``) once the events ``after`` have passed; on CUDA on the widening
        stream, returning the event that says it is done (``None`` on a CPU target)."""
        if not self.cuda:
            self.widening[unit.index].run(src, dst, views)
            return None
        with torch.cuda.stream(self.widen_stream):
            for event in after:
                self.widen_stream.wait_event(event)
            self.widening[unit.index].run(src, dst, views)
            return self.widen_stream.record_event()

    def keep_as_stored(self, units: list[Unit]) -> None:
        """Keep a device copy of each of ``units`` in its storage layout (fp8 codes and scales),
        dropping the copies of units no longer listed; loads of these widen from there."""
        wanted = {u.index for u in units}
        self._after_compute()
        for i in [i for i in self.staged if i in wanted]:  # widened from the device copy from now on
            del self.staged[i]
        for i in [i for i in self.stored if i not in wanted]:
            buf = self.stored.pop(i)
            if self.cuda:  # widenings still queued may read it
                buf.record_stream(self.widen_stream)
        for unit in units:
            if unit.index not in self.stored:
                buf = torch.empty(unit.host_bytes, dtype=torch.uint8, device=self.device)
                src = self.arena.region(unit.host_offset, unit.host_bytes)
                if self.cuda:
                    with torch.cuda.stream(self.copy_stream):
                        buf.copy_(src, non_blocking=True)
                else:
                    buf.copy_(src)
                self.stored[unit.index] = buf
        if self.cuda and units:  # widenings from these copies wait for them to land
            self.widen_stream.wait_stream(self.copy_stream)

    def copy_to(self, unit: Unit, buf: torch.Tensor) -> None:
        """Copy ``unit`` into ``buf`` (a device buffer of its own, kept for good) and point it there."""
        views = [typed_view(buf, r.dev_offset, r.compute_dtype, r.shape) for r in unit.tensors]
        self._after_compute()
        landed = self._copy(unit, buf, views)
        if landed is not None:  # settle() orders compute after the copy stream; widening is on another
            self.copy_stream.wait_event(landed)
        for rec, view in zip(unit.tensors, views):
            rec.param.data = view

    def _after_compute(self) -> None:
        """Side-stream writes into memory just allocated on the compute stream wait for the compute
        issued so far: the allocator may hand out memory that queued kernels still use."""
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            if self.widen_stream is not None:
                self.widen_stream.wait_stream(torch.cuda.current_stream(self.device))

    def settle(self) -> None:
        """Compute issued from now on sees every copy (and widening) issued so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            if self.widen_stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.widen_stream)

    def wait_ready(self, unit: Unit) -> None:
        """Make the current (compute) stream wait until ``unit``'s copy has landed."""
        if self.cuda:
            ev = self.ready.pop(unit.index, None)
            if ev is not None:
                if not ev.query():  # the copy is still running: compute will wait for it (a stall)
                    self.stalls += 1
                torch.cuda.current_stream(self.device).wait_event(ev)

    def evict(self, slot: Slot) -> None:
        """Point the occupant back at its host master; the slot may be overwritten once the compute
        issued so far has run (``free_event``)."""
        unit = slot.occupant
        if unit is None:
            return
        self.bind_host(unit)
        if self.poison:  # debug: stale references to the slot now read NaN/garbage, loudly
            slot.buf.fill_(255)
        if self.cuda:
            # A copy that landed but was never used needs no wait here: the next write into this
            # slot waits for it (``slot.landed``).
            self.ready.pop(unit.index, None)
            slot.free_event = torch.cuda.current_stream(self.device).record_event()
        slot.occupant = None
        del self.slot_of[unit.index]

    def home_slot(self, unit: Unit, keep: set[int] | None = None) -> Slot | None:
        """``unit``'s home slot, emptied; ``None`` if a unit in ``keep`` lives there now."""
        slot = self.slots[self.home[unit.index]]
        if slot.occupant is not None:
            if keep is not None and slot.occupant.index in keep:
                return None
            self.evict(slot)
        return slot

    def rehome(self, order: list[int]) -> None:
        """Homes round robin over ``order`` (streamed unit indices as executed); evicts whatever
        would no longer sit in its home."""
        n = max(len(self.slots), 1)
        new = {idx: i % n for i, idx in enumerate(order)}
        for slot in self.slots:
            if slot.occupant is not None and new.get(slot.occupant.index) != slot.index:
                self.evict(slot)
        self.home.update(new)

    def evict_all(self, keep=None) -> None:
        """Evict every occupant, except those for which ``keep(unit)`` is true."""
        for slot in self.slots:
            if slot.occupant is not None and not (keep is not None and keep(slot.occupant)):
                self.evict(slot)
