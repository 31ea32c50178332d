"""Attach-time bookkeeping: which tensor goes where, and how to put everything back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .arena import HostArena, typed_view
from .units import TensorRecord, Unit, align_up, candidate_modules, find_block_containers, owners_of

GIB = 2**30


@dataclass
class Plan:
    device: torch.device
    units: list[Unit]  # every unit, execution-order guess (registration order)
    streamed: list[Unit]  # units that go through the slots
    budget: list[Unit]  # units kept on the device for good (vram_budget_gb)
    resident_params: list[tuple[nn.Parameter, torch.device]] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str, torch.device]] = field(default_factory=list)
    host_trainable: list[nn.Parameter] = field(default_factory=list)  # optimizer offload
    arena_bytes: int = 0
    blocks: bool = False  # units are children of block containers (their order is the execution order)
    trainable_dtype: torch.dtype | None = None
    budget_bufs: list[torch.Tensor] = field(default_factory=list)

    def move_resident(self) -> None:
        for p, _ in self.resident_params:
            upcast = self.trainable_dtype if p.requires_grad and p.is_floating_point() else None
            p.data = p.data.to(self.device, dtype=upcast)
        moved: dict[int, torch.Tensor] = {}  # a buffer shared by two modules stays shared
        for mod, name, _ in self.buffers:
            buf = mod._buffers[name]
            mod._buffers[name] = moved.setdefault(id(buf), buf.to(self.device))

    def fill_arena(self, arena: HostArena, copy: bool = True) -> None:
        """Copy every unit's weights into the arena, one tensor at a time, so host RAM never holds
        more than the arena plus one tensor of the original model.  ``copy=False``: another process
        filled this (shared) arena; only point the weights at it."""
        for unit in self.streamed:
            for rec in unit.tensors:
                master = typed_view(arena.buffer, unit.host_offset + rec.host_offset, rec.store_dtype, rec.shape)
                if copy:
                    master.copy_(rec.param.data)
                rec.param.data = master

    def load_budget_units(self, arena: HostArena) -> None:
        for unit in self.budget:
            buf = torch.empty(unit.dev_bytes, dtype=torch.uint8, device=self.device)
            for rec in unit.tensors:
                view = typed_view(buf, rec.dev_offset, rec.compute_dtype, rec.shape)
                view.copy_(rec.param.data)
                rec.param.data = view
            self.budget_bufs.append(buf)

    def restore(self, streamer) -> None:
        """Real weights back on their original devices and dtypes; buffers keep their updates."""
        for unit in self.units:
            for rec in unit.tensors:
                rec.param.data = rec.param.data.to(device=rec.orig_device, dtype=rec.orig_dtype, copy=True)
        self.budget_bufs.clear()
        for p, dev in self.resident_params:
            p.data = p.data.to(dev)
        moved: dict[int, torch.Tensor] = {}
        for mod, name, dev in self.buffers:
            buf = mod._buffers[name]
            mod._buffers[name] = moved.setdefault(id(buf), buf.to(dev))


def build_plan(model: nn.Module, device: torch.device, granularity: str, block_container_names,
               optimizer_offload: bool, storage_dtype, vram_budget_gb: float,
               trainable_dtype: torch.dtype | None = None) -> Plan:
    owners = owners_of(model)
    candidates = candidate_modules(model, granularity, block_container_names)
    claimed = _claims(candidates)
    units, unit_param_ids = [], set()
    for name, mod in candidates:
        unit = Unit(len(units), name, mod)
        for p, inside in _subtree_params(mod):
            if claimed[id(p)] == 1 and inside == owners[id(p)] and (optimizer_offload or not p.requires_grad):
                unit.tensors.append(_record(p, storage_dtype))
                unit_param_ids.add(id(p))
        if unit.tensors:
            unit.layout()
            units.append(unit)
    plan = Plan(device, units, [], [], trainable_dtype=trainable_dtype,
                blocks=granularity == "block" and bool(find_block_containers(model, block_container_names)))
    _split_budget(plan, vram_budget_gb)
    _place_in_arena(plan)
    seen: set[int] = set()
    for p in model.parameters():  # parameters() de-duplicates shared parameters
        if id(p) not in unit_param_ids and id(p) not in seen:
            seen.add(id(p))
            plan.resident_params.append((p, p.device))
    plan.buffers = [(mod, n, b.device) for mod in model.modules() for n, b in mod._buffers.items() if b is not None]
    plan.host_trainable = [r.param for u in plan.streamed for r in u.tensors if r.trainable]
    return plan


def _claims(candidates) -> dict[int, int]:
    """In how many candidate units each parameter appears (shared between units -> resident)."""
    counts: dict[int, int] = {}
    for _, mod in candidates:
        for p, _ in _subtree_params(mod):
            counts[id(p)] = counts.get(id(p), 0) + 1
    return counts


def _subtree_params(mod: nn.Module):
    """Each distinct parameter under ``mod`` with how many (module, attribute) slots hold it there."""
    inside: dict[int, list] = {}
    for sub in mod.modules():
        for p in sub._parameters.values():
            if p is not None:
                inside.setdefault(id(p), [p, 0])[1] += 1
    return [(p, n) for p, n in inside.values()]


def _record(p: nn.Parameter, storage_dtype) -> TensorRecord:
    store = p.dtype
    if storage_dtype is not None and not p.requires_grad and p.dtype.is_floating_point:
        store = storage_dtype
    return TensorRecord(p, p.shape, p.dtype, p.device, store, p.dtype)


def _place_in_arena(plan: Plan) -> None:
    off = 0
    for unit in plan.streamed:  # budget units go straight to the device: no host copy
        unit.host_offset = off
        off = align_up(off + unit.host_bytes)
    plan.arena_bytes = off


def _split_budget(plan: Plan, vram_budget_gb: float) -> None:
    """Keep as many units resident as the budget allows, evenly spaced over the order (so the
    copies of the streamed ones overlap the compute of the resident ones between them)."""
    n, budget = len(plan.units), int(vram_budget_gb * GIB)
    avg = sum(u.dev_bytes for u in plan.units) / max(n, 1)
    k = min(n, int(budget // avg)) if avg else 0
    while k > 0:
        picks = {int((i + 0.5) * n / k) for i in range(k)}
        if sum(plan.units[i].dev_bytes for i in picks) <= budget:
            break
        k -= 1
    picks = {int((i + 0.5) * n / k) for i in range(k)} if k else set()
    plan.budget = [u for u in plan.units if u.index in picks and not any(r.trainable for r in u.tensors)]
    plan.streamed = [u for u in plan.units if u not in plan.budget]
