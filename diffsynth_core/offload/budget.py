"""The byte plan: which units stay on the device under a GPU memory budget.

The budget is a cap on the device's peak memory (``torch.cuda.max_memory_allocated``), not on the
weights alone, so the planner needs what a step costs besides the units: activations, trainable
weights with their gradients and optimizer state, the streaming slots.  Those are *measured*:
the first step runs with every unit streamed, and at the start of the second one (when the
optimizer state exists) ``overhead = peak of step 1 + what stayed allocated since``.  Whatever the
budget leaves above that (minus a margin) holds resident units.

Which ones: each unit's residency saves the bytes it would have been copied in a step.  The first
step records every use of every unit (forward, recompute, backward) and a replay of the slots
(``simulate_loads``) counts the copies each unit costs: two per step for most, one for the units
the slots keep across the forward->backward turn (and, for frozen weights, across the
backward->forward turn into the next step).  Units are taken by bytes saved per device byte, and
among equals spread evenly over the execution order, so the copies of the streamed ones overlap
the compute of the resident ones between them; when the same number spread over every unit copies
no more bytes and leaves fewer streamed units back to back, that plan is taken instead.  A unit
stored in another dtype (fp8) is kept on the device *as stored* ("compact": half the bytes of bf16
for the same bytes saved) and widened into a slot at each use like a streamed one, without
crossing PCIe; only when every unit fits that way does the rest of the budget keep some of them
widened (no widening, no slot).  The same replay, run on the final plan, gives the planned bytes
per step that ``report()`` sets beside the measured ones.

Units with trainable weights stepping on the host (optimizer offload) are never kept resident: their
weights change with every step.  What the budget leaves after the resident units buys more slots
instead (``slot_bytes`` each): with ``n`` slots the ring still holds the forward's last ``n``
units when backward starts, so each slot more keeps one more unit across that turn: one copy a
step instead of two.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from .units import Unit

GIB = 2**30


def margin_bytes(budget: int) -> int:
    """Head-room kept under the budget: allocator rounding and step-to-step variation."""
    return 256 * 2**20 + budget // 50


def auto_budget(device: torch.device) -> int:
    """``"auto"``: what the device has free now (plus what this process has already taken),
    minus 5 % of the card for other processes and the CUDA context growing."""
    if device.type != "cuda":
        raise InputError("offload.vram_budget_gb = 'auto' needs a CUDA device; give a number of GiB instead")
    free, total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - total // 20)


class DeviceMemory:
    """Allocated / peak bytes of the target device; ``None`` where the device keeps no statistics
    (CPU), in which case the planner counts what the engine itself placed there."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)


def simulate_loads(uses: list[int], streamed: list[int], n_slots: int, keep_across: set[int],
                   steps: int = 2) -> Counter:
    """Copies per unit in the last of ``steps`` identical steps: a use copies its unit unless the
    unit still sits in its home slot (homes round robin over ``streamed``, which is in execution
    order).  Units in ``keep_across`` (frozen ones) stay in their slots from one step to the next."""
    home = {u: i % max(n_slots, 1) for i, u in enumerate(streamed)}
    slots: dict[int, int] = {}
    counts: Counter = Counter()
    for step in range(steps):
        counts = Counter()
        for u in uses:
            if u not in home:
                continue
            if slots.get(home[u]) != u:
                slots[home[u]] = u
                counts[u] += 1
        slots = {h: u for h, u in slots.items() if u in keep_across}
    return counts


def unstepped_state_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Optimizer state still to come on ``device``: the weights the optimizer has not stepped yet (the
    LoRA of an expert no step has routed to so far) at the state bytes per weight byte of those it
    has.  The first step's peak holds only the state of what that step trained."""
    stepped = unstepped = state = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device != device:
                continue
            held = [t for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t) and t.device == device]
            if held:
                stepped += p.nbytes
                state += sum(t.nbytes for t in held)
            elif p.requires_grad:
                unstepped += p.nbytes
    return unstepped * state // stepped if stepped else 0


def forward_order(uses: list[int]) -> list[int]:
    """Distinct units in order of first use."""
    return list(dict.fromkeys(uses))


@dataclass
class ByteBudget:
    resident: list[Unit]  # kept on the device in the compute dtype, in execution order
    planned_bytes: int  # host->device bytes per step once planned
    streamed_bytes: int  # the same with every unit streamed (what residency saves from)
    compact: list[Unit] = field(default_factory=list)  # kept on the device as stored (fp8), widened per use
    extra_slots: int = 0  # slots to add, to keep more streamed units across the forward->backward turn
    device_bytes: int = 0  # what the plan adds to the device: resident and compact units, extra slots


def device_cost(u: Unit) -> int:
    """Device bytes a unit takes to keep: a unit stored in another dtype (fp8) is kept as stored
    (half the bytes of bf16) and widened into a slot at each use, like a streamed one."""
    return u.host_bytes if u.casts else u.dev_bytes


def plan_residency(units: list[Unit], uses: list[int], n_slots: int, room: int, slot_bytes: int = 0) -> ByteBudget:
    """Fill ``room`` device bytes with the units whose residency saves the most copied bytes, then
    what is left with slots of ``slot_bytes`` (0: add none) while they keep more units across the turn."""
    by_index = {u.index: u for u in units}
    used = set(uses)
    order = [i for i in forward_order(uses) if i in by_index] + [u.index for u in units if u.index not in used]
    position = {idx: pos for pos, idx in enumerate(order)}
    candidates = [u for u in units if not u.trainable and u.dev_bytes > 0]
    keep_across = {u.index for u in candidates}
    loads = simulate_loads(uses, order, n_slots, keep_across)

    def planned_bytes(kept: set[int], on_device: set[int] = frozenset(), slots: int = n_slots) -> int:
        """Host->device bytes a step with ``kept`` resident and ``slots`` slots; ``on_device``
        (compact) units pass through the slots without a copy."""
        after = simulate_loads(uses, [i for i in order if i not in kept], slots, keep_across)
        return sum(n * by_index[i].host_bytes for i, n in after.items() if i not in on_device)

    # Copied bytes saved per device byte spent; among equals, a unit that needs no widening wins.
    value = {u.index: (round(loads[u.index] * u.host_bytes / device_cost(u), 3), not u.casts) for u in candidates}
    chosen: list[Unit] = []
    whole_room = room
    for v in sorted(set(value.values()), reverse=True):
        if v[0] <= 0:
            break
        group = sorted((u for u in candidates if value[u.index] == v), key=lambda u: position[u.index])
        picked = _evenly_spaced(group, room, device_cost)
        room -= sum(device_cost(u) for u in picked)
        chosen.extend(picked)
    if chosen and not any(u.casts for u in candidates):
        # Taking the most-saving units first can leave streamed units back to back (the ones at the
        # turns save one copy, not two, so none of them is kept); the same number spread over every
        # unit often copies as many bytes, and then wins: each copy has more compute to hide behind.
        spread = _evenly_spaced(sorted(candidates, key=lambda u: position[u.index]), whole_room, device_cost)
        by_value, evenly = {u.index for u in chosen}, {u.index for u in spread}
        if planned_bytes(evenly) <= planned_bytes(by_value) and \
                _back_to_back(uses, evenly, by_index) < _back_to_back(uses, by_value, by_index):
            chosen = spread
    compact = [u for u in chosen if u.casts]
    if len(chosen) == len(candidates) and compact:  # every unit fits as stored: widen what still fits
        widened = _evenly_spaced(sorted(compact, key=lambda u: position[u.index]), room,
                                 lambda u: u.dev_bytes - u.host_bytes)
        compact = [u for u in compact if u not in widened]
    resident = sorted((u for u in chosen if u not in compact), key=lambda u: position[u.index])
    compact.sort(key=lambda u: position[u.index])
    kept, on_device = {u.index for u in resident}, {u.index for u in compact}
    held = sum(u.dev_bytes for u in resident) + sum(u.host_bytes for u in compact)
    slotted = sum(1 for u in units if u.index not in kept and u.dev_bytes > 0)  # pass through the slots
    extra = min(max(0, slotted - n_slots), (whole_room - held) // slot_bytes) if slot_bytes > 0 else 0
    # compact units still pass through the slots, widened from their device copy: nothing crosses PCIe
    return ByteBudget(resident, planned_bytes(kept, on_device, n_slots + extra),
                      sum(n * by_index[i].host_bytes for i, n in loads.items()), compact, extra,
                      held + extra * slot_bytes)


def _back_to_back(uses: list[int], kept: set[int], by_index: dict[int, Unit]) -> int:
    """Streamed units right after another streamed one in the forward: each copy has only the unit
    before it to hide behind."""
    streamed = [i not in kept and by_index[i].dev_bytes > 0 for i in forward_order(uses) if i in by_index]
    return sum(a and b for a, b in zip(streamed, streamed[1:]))


def static_residency(units: list[Unit], room: int) -> list[Unit]:
    """``resident_gb``: frozen units that fit in ``room`` bytes, evenly spaced over the registration
    order, chosen at attach without measuring (for callers that plan their device memory themselves)."""
    return _evenly_spaced([u for u in units if not u.trainable], room,
                          lambda u: u.dev_bytes)


def _evenly_spaced(group: list[Unit], room: int, cost) -> list[Unit]:
    """The largest evenly spaced subset of ``group`` (midpoints of k equal stretches) whose ``cost`` fits."""
    n = len(group)
    for k in range(n, 0, -1):
        picks = [group[(2 * i + 1) * n // (2 * k)] for i in range(k)]
        if sum(cost(u) for u in picks) <= room:
            return picks
    return []


class BudgetTracker:
    """Measures the first step, says when to plan, and watches the peak afterwards.

    ``fixed``: device bytes the engine itself placed (resident leftovers, slots), which is all a
    device without memory statistics can tell; on CUDA the first step's measured peak replaces it.
    """

    def __init__(self, budget: int, device: torch.device, fixed: int):
        self.budget, self.fixed = budget, fixed
        self.memory = DeviceMemory(device)
        # Without statistics the count is exact (only the engine's own bytes); with them, keep
        # head-room for allocator rounding and step-to-step variation.
        self.margin = margin_bytes(budget) if self.memory.cuda else 0
        self.start_allocated: int | None = None
        self.first_peak: int | None = None
        self.first_step_peak: int | None = None  # the peak up to the end of the first optimizer.step()
        self.peak = 0  # highest allocated bytes seen at the end of a step (CUDA)
        self.planned_peak: int | None = None
        self.over_budget_steps = 0
        self.advice = ""  # what else would make the step fit, from who knows (e.g. the activation offload)
        if fixed + self.margin > budget:
            raise self.too_small(fixed, "the slots and the weights outside the streamed blocks")

    def begin_first_step(self) -> None:
        self.start_allocated = self.memory.allocated()
        self.memory.reset_peak()

    def end_step(self, first: bool) -> None:
        peak = self.memory.peak()
        if peak is None:
            return
        self.peak = max(self.peak, peak)
        if first:
            self.first_peak = peak
        elif peak > self.budget:
            self.over_budget_steps += 1

    def optimizer_stepped(self) -> None:
        """Called after each ``optimizer.step()``: the first one's peak is part of what a step needs
        (read then, before anything else between steps, e.g. a validation render, can raise it)."""
        if self.first_step_peak is None and self.first_peak is not None:
            self.first_step_peak = self.memory.peak()

    def room(self, state_to_come: int = 0) -> int:
        """Device bytes left for resident units; raises when the step alone does not fit.
        ``state_to_come``: optimizer state the first step did not create (``unstepped_state_bytes``)."""
        if self.first_peak is None:  # no statistics: only what the engine placed is known
            overhead = self.fixed
            what = "the slots and the weights outside the streamed blocks"
        else:  # the step's peak + what stayed allocated since it began (optimizer state, ...), or the
            # peak of the first optimizer step if higher: state that waits on the host between steps
            # (HostOptimizerState) is back on the device, beside every gradient, while it steps
            overhead = max(self.first_peak + max(0, self.memory.allocated() - self.start_allocated),
                           self.first_step_peak or 0) + state_to_come
            what = "one training step with every block streamed" + \
                (" and the optimizer state of the weights it did not train" if state_to_come else "")
        room = self.budget - overhead - self.margin
        if room < 0:
            raise self.too_small(overhead, what)
        self.planned_peak = overhead
        return room

    def too_small(self, need: int, what: str) -> InputError:
        return InputError(
            f"offload.vram_budget_gb = {_size(self.budget)} cannot hold {what}: that needs "
            f"{_size(need)} plus {_size(self.margin)} of margin; raise the budget{self.advice} "
            f"or lower the resolution, batch or prefetch")


def _size(nbytes: int) -> str:
    """GiB with two decimals, or MiB below 0.1 GiB (a tiny model's needs would all read 0.00 GiB)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"
