"""Attach-time bookkeeping: which tensor goes where, and how to put everything back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import packed
from .arena import typed_view
from .quant import dequantize_rows, quantize_rows
from .units import TensorRecord, Unit, align_up, candidate_modules, find_block_containers, owners_of

MIB = 2**20


def stage_count(device: torch.device) -> int:
    """Staging buffers for widened units: two on CUDA (copy and widening overlap), one elsewhere."""
    return 2 if device.type == "cuda" else 1


@dataclass
class Plan:
    device: torch.device
    units: list[Unit]  # every unit, execution-order guess (registration order)
    streamed: list[Unit]  # units that go through the slots
    budget: list[Unit]  # units kept on the device (chosen by the budget planner)
    compact: list[Unit] = field(default_factory=list)  # kept on the device as stored (fp8); still in ``streamed``
    resident_params: list[tuple[nn.Parameter, torch.device]] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str, torch.device]] = field(default_factory=list)
    host_trainable: list[nn.Parameter] = field(default_factory=list)  # optimizer offload
    arena_bytes: int = 0
    blocks: bool = False  # units are children of block containers (their order is the execution order)
    trainable_dtype: torch.dtype | None = None
    budget_bufs: dict[int, torch.Tensor] = field(default_factory=dict)

    def move_resident(self) -> None:
        for p, _ in self.resident_params:
            upcast = self.trainable_dtype if p.requires_grad and p.is_floating_point() else None
            p.data = p.data.to(self.device, dtype=upcast)
        self._move_buffers(back=False)

    def fixed_bytes(self, n_slots: int) -> int:
        """Device bytes the engine places itself: everything outside the units (trainable weights
        in ``trainable_dtype``), the streaming slots and the widening stages."""
        resident = 0
        for p, _ in self.resident_params:
            size = self.trainable_dtype.itemsize if p.requires_grad and self.trainable_dtype else p.element_size()
            resident += p.numel() * size
        buffers = {id(m._buffers[n]): m._buffers[n] for m, n, _ in self.buffers}
        resident += sum(t.numel() * t.element_size() for t in buffers.values())
        slots = n_slots * max((u.dev_bytes for u in self.units), default=0)
        stage = max((u.host_bytes for u in self.units if u.casts), default=0) * stage_count(self.device)
        return resident + slots + stage

    # --- host copies ---------------------------------------------------------------------------
    def fill_arena(self, arena, copy: bool = True) -> None:
        """Copy every unit's weights into the arena (fp8 codes + scales, or packed codes, where
        asked), one tensor at a time, dropping each original as it goes: host RAM never holds two
        copies of the model.  ``copy=False``: another process filled this (shared) arena; only point
        the weights at it."""
        for unit in self.units:
            for rec in unit.tensors:
                master = master_view(arena.buffer, unit, rec)
                if copy and rec.quantized:
                    q, scales = quantize_rows(self._encode_on(rec.param.data), rec.store_dtype)
                    master.copy_(q)
                    scale_view(arena.buffer, unit, rec).copy_(scales)
                elif copy and rec.packed:
                    _fill_packed(arena.buffer, unit, rec, self._encode_on(rec.param.data))
                elif copy:
                    master.copy_(rec.param.data)
                rec.param.data = master

    def _encode_on(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` where encoding it is fastest: the CUDA target if there is one."""
        return weight.to(self.device) if self.device.type == "cuda" else weight

    # --- device copies kept for good (budget) --------------------------------------------------
    def set_budget(self, keep: list[Unit], streamer, compact: list[Unit] = ()) -> None:
        """Units in ``keep`` live on the device from now on (widened); those in ``compact`` too, as
        stored, widened into a slot at each use; the others stream.  Call with nothing loaded in
        the slots."""
        wanted = {u.index for u in keep}
        for unit in self.budget:
            if unit.index not in wanted:
                streamer.bind_host(unit)
                del self.budget_bufs[unit.index]
        for unit in keep:
            if unit.index not in self.budget_bufs:
                buf = torch.empty(unit.dev_bytes, dtype=torch.uint8, device=self.device)
                streamer.copy_to(unit, buf)
                self.budget_bufs[unit.index] = buf
        streamer.keep_as_stored(compact)
        streamer.settle()
        self.budget, self.compact = list(keep), list(compact)
        self.streamed = [u for u in self.units if u.index not in wanted]

    # --- detach ----------------------------------------------------------------------------------
    def restore(self, arena_buffer: torch.Tensor, frozen: bool = True, in_place: bool = True) -> None:
        """Weights back on their original devices and dtypes, without a second host copy: a weight
        stored unchanged in the arena keeps its arena memory (the arena is then only unpinned).
        ``frozen=False`` drops the frozen unit weights instead (meta tensors: the base is released,
        only trainable weights come back).  ``in_place=False`` copies every weight out (an arena
        shared with other processes must not stay under this model's weights).  Buffers keep their
        updates."""
        on_device = {u.index for u in self.budget}
        for unit in self.units:
            for rec in unit.tensors:
                if not frozen and not rec.trainable:
                    _release(unit.module, rec)
                else:
                    rec.param.data = _restored(arena_buffer, unit, rec, unit.index in on_device, in_place)
        self.budget_bufs.clear()
        for p, dev in self.resident_params:
            p.data = p.data.to(dev)
        self._move_buffers(back=True)

    def _move_buffers(self, back: bool) -> None:
        """Every buffer to the target device (``back``: to where it was); a buffer shared by two
        modules stays shared."""
        moved: dict[int, torch.Tensor] = {}
        for mod, name, origin in self.buffers:
            buf = mod._buffers[name]
            if id(buf) not in moved:
                moved[id(buf)] = buf.to(origin if back else self.device)
            mod._buffers[name] = moved[id(buf)]


def _release(root: nn.Module, rec: TensorRecord) -> None:
    """Replace the parameter by a meta one (same shape and dtype, no memory) where it is held."""
    meta = nn.Parameter(torch.empty(rec.shape, dtype=rec.orig_dtype, device="meta"), requires_grad=False)
    for mod in root.modules():
        for name, p in mod._parameters.items():
            if p is rec.param:
                mod._parameters[name] = meta
    rec.param.data = torch.empty(0, dtype=rec.param.dtype)  # the old object must not keep the arena alive


def _restored(arena_buffer: torch.Tensor, unit: Unit, rec: TensorRecord, on_device: bool,
              in_place: bool) -> torch.Tensor:
    data = rec.param.data
    if on_device:  # a device copy (already widened)
        return data.to(device=rec.orig_device, dtype=rec.orig_dtype, copy=True)
    if rec.quantized:
        return dequantize_rows(data, scale_view(arena_buffer, unit, rec), rec.orig_dtype).to(rec.orig_device)
    if rec.packed:
        return decode_packed(arena_buffer, unit, rec).to(rec.orig_device)
    if in_place and data.dtype == rec.orig_dtype and rec.orig_device.type == "cpu":
        return data  # in place: the arena's memory becomes the weight's memory
    return data.to(device=rec.orig_device, dtype=rec.orig_dtype, copy=True)


def master_view(buf: torch.Tensor, unit: Unit, rec: TensorRecord) -> torch.Tensor:
    return typed_view(buf, unit.host_offset + rec.host_offset, rec.store_dtype, rec.shape)


def scale_view(buf: torch.Tensor, unit: Unit, rec: TensorRecord) -> torch.Tensor:
    return typed_view(buf, unit.host_offset + rec.scale_offset, torch.float32, torch.Size([rec.shape[0]]))


def nibble_view(buf: torch.Tensor, unit: Unit, rec: TensorRecord, start: int | None = None) -> torch.Tensor:
    """A packed tensor's exponent codes in ``buf`` (the arena, or ``unit``'s region from ``start``)."""
    return typed_view(buf, _region(unit, start) + rec.nibble_offset, torch.uint8,
                      torch.Size([packed.nibble_bytes(rec.numel)]))


def escape_views(buf: torch.Tensor, unit: Unit, rec: TensorRecord | None = None,
                 start: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, bits) of ``unit``'s escape table in ``buf`` (the arena, or the unit's region from
    ``start``), or only ``rec``'s rows; positions count int16 elements of the compute layout."""
    first, rows = (0, unit.escapes) if rec is None else (rec.escape_start, rec.escapes)
    at = _region(unit, start)
    positions = typed_view(buf, at + unit.escape_offset + 8 * first, torch.int64, torch.Size([rows]))
    bits = typed_view(buf, at + unit.escape_bits_offset + 2 * first, torch.int16, torch.Size([rows]))
    return positions, bits


def decode_packed(buf: torch.Tensor, unit: Unit, rec: TensorRecord, start: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``rec`` (packed) decoded from ``buf`` (the arena, or ``unit``'s region from ``start``), escapes
    included, into ``out`` or a new tensor: the eager path, and the reference of the kernel."""
    at = _region(unit, start)
    lows = typed_view(buf, at + rec.host_offset, torch.uint8, rec.shape)
    positions, bits = escape_views(buf, unit, rec, start)
    return packed.decode(lows, nibble_view(buf, unit, rec, start), rec.packed_base,
                         positions - rec.dev_offset // 2, bits, out=out)


def _region(unit: Unit, start: int | None) -> int:
    """Where ``unit``'s stored bytes begin: in the arena, or at ``start`` of another buffer."""
    return unit.host_offset if start is None else start


def _fill_packed(buf: torch.Tensor, unit: Unit, rec: TensorRecord, weight: torch.Tensor) -> None:
    lows, nibbles, positions, bits = packed.pack(weight, rec.packed_base)
    if positions.numel() != rec.escapes:  # the weight changed between planning and filling
        raise RuntimeError(f"offload: {unit.name} changed while the engine attached "
                           f"({positions.numel()} escapes, {rec.escapes} planned)")
    master_view(buf, unit, rec).copy_(lows)
    nibble_view(buf, unit, rec).copy_(nibbles)
    table_positions, table_bits = escape_views(buf, unit, rec)
    table_positions.copy_(positions + rec.dev_offset // 2)
    table_bits.copy_(bits)


def build_plan(model: nn.Module, device: torch.device, granularity: str, block_container_names,
               optimizer_offload: bool, storage_dtype, trainable_dtype: torch.dtype | None = None,
               split_bytes: int | None = None) -> Plan:
    owners = owners_of(model)
    candidates = candidate_modules(model, granularity, block_container_names, split_bytes)
    claimed = _claims(candidates)
    units, unit_param_ids = [], set()
    for name, mod in candidates:
        unit = Unit(len(units), name, mod)
        for p, inside in _subtree_params(mod):
            if claimed[id(p)] == 1 and inside == owners[id(p)] and (optimizer_offload or not p.requires_grad):
                unit.tensors.append(_record(p, storage_dtype, device))
                unit_param_ids.add(id(p))
        if unit.tensors:
            unit.layout()
            units.append(unit)
    plan = Plan(device, units, list(units), [], trainable_dtype=trainable_dtype,
                blocks=granularity == "block" and bool(find_block_containers(model, block_container_names)))
    _place_in_arena(plan)
    seen: set[int] = set()
    for p in model.parameters():  # parameters() de-duplicates shared parameters
        if id(p) not in unit_param_ids and id(p) not in seen:
            seen.add(id(p))
            plan.resident_params.append((p, p.device))
    plan.buffers = [(mod, n, b.device) for mod in model.modules() for n, b in mod._buffers.items() if b is not None]
    plan.host_trainable = [r.param for u in plan.units for r in u.tensors if r.trainable]
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


def _record(p: nn.Parameter, storage_dtype, device: torch.device) -> TensorRecord:
    if storage_dtype == packed.PACKED:
        return _packed_record(p, device)
    store = p.dtype
    if storage_dtype is not None and not p.requires_grad and p.dtype.is_floating_point:
        # fp8 codes need a row to scale: 1-D tensors (biases, norm scales) keep their dtype.
        if p.dim() >= 2 or storage_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            store = storage_dtype
    return TensorRecord(p, p.shape, p.dtype, p.device, store, p.dtype)


def _packed_record(p: nn.Parameter, device: torch.device) -> TensorRecord:
    """A frozen bf16 weight of two or more dimensions packed (``packed``) unless its exponents
    spread so wide that escapes would cost more than they save; anything else as it is."""
    rec = TensorRecord(p, p.shape, p.dtype, p.device, p.dtype, p.dtype)
    if p.requires_grad or not packed.packable(p.data):
        return rec
    base, escapes = packed.choose_base(p.data.to(device) if device.type == "cuda" else p.data)
    if escapes <= p.numel() * packed.MAX_ESCAPE_SHARE:
        rec.store_dtype, rec.packed, rec.packed_base, rec.escapes = torch.uint8, True, base, escapes
    return rec


def _place_in_arena(plan: Plan) -> None:
    off = 0
    for unit in plan.units:  # every unit has a host copy; budget units also get a device copy
        unit.host_offset = off
        off = align_up(off + unit.host_bytes)
    plan.arena_bytes = off
