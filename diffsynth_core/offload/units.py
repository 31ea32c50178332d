"""Partition a model into streamed units and resident leftovers.

A *unit* is the smallest group of weights that is copied to the device in one piece: a child of
one of the model's ModuleLists of blocks (``granularity="block"``) or a parameter-owning leaf
module (``granularity="leaf"``).  With a split threshold, a unit larger than the threshold (bytes)
is replaced by its parameter-owning children, recursively, down to leaves.  Everything the units
do not own exclusively (parameters shared between units, parameters owned directly by non-leaf
modules outside units or by a split module, all buffers) is *resident*: moved to the target device
once at attach, because it may be read by code that fires no hook (a root ``forward`` reading
``scale_shift_table``, a buffer mutated in place, ...).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from .packed import nibble_bytes
from .quant import FP8_MAX

ALIGN = 64  # bytes; every tensor starts on a 64-byte boundary inside a unit's region


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(eq=False)
class TensorRecord:
    """One parameter of a unit: where its bytes live in the host region and in a device slot."""

    param: nn.Parameter
    shape: torch.Size
    orig_dtype: torch.dtype
    orig_device: torch.device
    store_dtype: torch.dtype  # dtype in host memory (and in the H2D copy)
    compute_dtype: torch.dtype  # dtype the forward sees
    host_offset: int = 0  # into the unit's host region (store layout; also the staging layout)
    dev_offset: int = 0  # into a device slot (compute layout)
    scale_offset: int = -1  # per-row float32 scales after the data in the host region (fp8 storage)
    packed: bool = False  # stored as 12-bit codes (``packed``): lows at host_offset, then nibbles
    packed_base: int = 0  # the first exponent of the window codes 1..14 stand for
    escapes: int = 0  # weights whose exponent has no code: their bits are kept in the unit's escape table
    nibble_offset: int = -1  # into the unit's host region (packed storage)
    escape_start: int = 0  # this tensor's first row in the unit's escape table

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad

    @property
    def needs_cast(self) -> bool:
        return self.store_dtype != self.compute_dtype

    @property
    def quantized(self) -> bool:
        """Stored as fp8 codes with one power-of-two scale per row (see ``quant``)."""
        return self.store_dtype in FP8_MAX


@dataclass(eq=False)
class Unit:
    index: int
    name: str
    module: nn.Module
    tensors: list[TensorRecord] = field(default_factory=list)
    host_bytes: int = 0  # bytes in the host region (store layout)
    dev_bytes: int = 0  # bytes in a device slot (compute layout)
    host_offset: int = 0  # into the arena
    plain_bytes: int = 0  # leading bytes stored as computed: identical in both layouts
    escapes: int = 0  # rows of the escape table of its packed tensors (``packed``)
    escape_offset: int = 0  # positions (int64, in int16 elements of the compute layout) in the host region
    escape_bits_offset: int = 0  # their bits (int16), after the positions

    def layout(self) -> None:
        """Assign 64-byte aligned offsets: host (store dtype) and device (compute dtype) layouts.
        Without casts the two layouts are identical, so one copy lands every tensor in place.  With
        casts, the tensors stored as computed come first (a stable sort): they sit at the same offsets
        in both layouts, so one copy of ``plain_bytes`` lands them all (``widening``)."""
        self.tensors.sort(key=lambda rec: rec.needs_cast)
        host = dev = self.escapes = 0
        for rec in self.tensors:
            rec.host_offset = host
            host = align_up(host + rec.numel * rec.store_dtype.itemsize)
            if rec.quantized:
                rec.scale_offset = host
                host = align_up(host + rec.shape[0] * 4)
            if rec.packed:
                rec.nibble_offset = host
                host = align_up(host + nibble_bytes(rec.numel))
                rec.escape_start, self.escapes = self.escapes, self.escapes + rec.escapes
            rec.dev_offset = dev
            dev = align_up(dev + rec.numel * rec.compute_dtype.itemsize)
            if not rec.needs_cast:
                self.plain_bytes = dev
        if self.escapes:  # one table for the unit: one launch writes every escaped weight back
            self.escape_offset = host
            self.escape_bits_offset = host = align_up(host + self.escapes * 8)
            host = align_up(host + self.escapes * 2)
        self.host_bytes, self.dev_bytes = host, dev

    @functools.cached_property
    def casts(self) -> bool:
        """Some of its tensors are stored in another dtype (read at every load: computed once, as a
        record's dtypes never change)."""
        return any(rec.needs_cast for rec in self.tensors)

    @property
    def trainable(self) -> bool:
        """Some of its weights train (such a unit is never kept resident)."""
        return any(rec.trainable for rec in self.tensors)


def _resolve(model: nn.Module, dotted: str) -> nn.Module:
    mod = model
    for part in dotted.split("."):
        if not hasattr(mod, part):
            raise ValueError(f"block container {dotted!r} not found on {type(model).__name__} (missing {part!r})")
        mod = getattr(mod, part)
    if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"block container {dotted!r} is a {type(mod).__name__}, expected nn.ModuleList/Sequential")
    return mod


def find_block_containers(model: nn.Module, names: tuple[str, ...] | list[str] | None) -> list[tuple[str, nn.Module]]:
    """Named containers whose children are the blocks.  ``None`` auto-detects: the outermost
    ModuleLists/Sequentials with at least two children that own parameters."""
    if names is not None:
        return [(n, _resolve(model, n)) for n in names]
    found: list[tuple[str, nn.Module]] = []
    inside: set[str] = set()
    for name, mod in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(mod, (nn.ModuleList, nn.Sequential)):
            with_params = [c for c in mod.children() if next(c.parameters(), None) is not None]
            if len(with_params) >= 2:
                found.append((name, mod))
                inside.add(name)
    return found


def find_blocks(model: nn.Module, block_container_names) -> list[nn.Module]:
    """Every child of the model's block containers (``find_block_containers``), in order; empty if none."""
    return [b for _, container in find_block_containers(model, block_container_names) for b in container.children()]


def candidate_modules(model: nn.Module, granularity: str, block_container_names,
                      split_bytes: int | None = None) -> list[tuple[str, nn.Module]]:
    """Modules that become units, in registration order (a first guess at execution order);
    those over ``split_bytes`` are split into their children, recursively."""
    found = _base_candidates(model, granularity, block_container_names)
    if split_bytes is None:
        return found
    return [piece for name, mod in found for piece in _split(name, mod, split_bytes)]


def _split(name: str, mod: nn.Module, limit: int) -> list[tuple[str, nn.Module]]:
    children = [(f"{name}.{n}", c) for n, c in mod.named_children() if next(c.parameters(), None) is not None]
    if not children or module_bytes(mod) <= limit:
        return [(name, mod)]
    return [piece for cname, child in children for piece in _split(cname, child, limit)]


def module_bytes(mod: nn.Module) -> int:
    """Bytes of the distinct parameters under ``mod``."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in mod.parameters()}.values())


def _base_candidates(model: nn.Module, granularity: str, block_container_names) -> list[tuple[str, nn.Module]]:
    if granularity == "block":
        containers = find_block_containers(model, block_container_names)
        if containers:
            return [(f"{cname}.{i}" if cname else str(i), child)
                    for cname, cont in containers for i, child in enumerate(cont.children())]
        granularity = "leaf"  # no blocks to speak of (e.g. a plain MLP): stream its leaves
    if granularity != "leaf":
        raise ValueError(f"granularity must be 'block' or 'leaf', got {granularity!r}")
    return [(n, m) for n, m in model.named_modules()
            if not any(True for _ in m.children()) and any(True for _ in m.parameters(recurse=False))]


def owners_of(model: nn.Module) -> dict[int, int]:
    """How many (module, attribute) slots hold each parameter, across the whole model."""
    counts: dict[int, int] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                counts[id(p)] = counts.get(id(p), 0) + 1
    return counts
