"""A unit stored in fp8 widened in few launches: its layout, and the same bits as tensor by tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffsynth_core.offload import widening
from diffsynth_core.offload.arena import HostArena, typed_view
from diffsynth_core.offload.plan import build_plan
from diffsynth_core.offload.widening import UnitWidening, widen_each

FP8 = torch.float8_e4m3fn


class Mixed(nn.Module):
    """Weights of ragged widths (a row not a multiple of the kernel's block, a conv), with biases and
    a norm scale registered between them, as real blocks interleave them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3000, 257)
        self.norm = nn.LayerNorm(257)
        self.conv = nn.Conv2d(3, 64, 5)
        self.b = nn.Linear(7, 5000, bias=False)
        self.c = nn.Linear(64, 64)


class Even(nn.Module):
    """Rows of a multiple of 16 weights, as in real models: the kernel's aligned variant."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3072, 272)
        self.norm = nn.LayerNorm(272)
        self.b = nn.Linear(16, 4096, bias=False)


def _model(seed: int = 0, block=Mixed) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(block(), block()).to(torch.bfloat16).requires_grad_(False)
    for p in model.parameters():  # rows spanning many binades, as fp8 row scales must survive
        p.data *= torch.logspace(-6, 1, p.shape[0]).view(-1, *[1] * (p.dim() - 1)).to(p.dtype)
    return model


def _plan(seed: int = 0, block=Mixed):
    return build_plan(_model(seed, block), torch.device("cpu"), "block", None, False, FP8)


def test_tensors_stored_as_computed_lead_both_layouts_at_the_same_offsets():
    unit = _plan().units[0]
    plain = [r for r in unit.tensors if not r.needs_cast]
    assert plain and unit.tensors[:len(plain)] == plain  # biases and the norm first
    assert all(r.host_offset == r.dev_offset for r in plain)
    last = plain[-1]
    assert last.dev_offset + last.numel * last.compute_dtype.itemsize <= unit.plain_bytes
    assert all(r.host_offset >= unit.plain_bytes and r.dev_offset >= unit.plain_bytes for r in unit.tensors[len(plain):])


def _stored_bytes(plan) -> torch.Tensor:
    """The first unit's host region as the arena holds it (what a copy lands in a staging buffer)."""
    arena = HostArena(plan.arena_bytes)
    plan.fill_arena(arena)
    unit = plan.units[0]
    return arena.buffer.narrow(0, unit.host_offset, unit.host_bytes).clone()


def _widened(unit, src, device, one_by_one: bool) -> torch.Tensor:
    dst = torch.zeros(unit.dev_bytes, dtype=torch.uint8, device=device)
    views = [typed_view(dst, r.dev_offset, r.compute_dtype, r.shape) for r in unit.tensors]
    if one_by_one:
        widen_each(unit, src, views)
    else:
        UnitWidening(unit, device).run(src, dst, views)
    return dst, views


def test_widening_a_unit_on_the_cpu_gives_each_tensor_its_own_widening():
    plan = _plan()
    unit, src = plan.units[0], _stored_bytes(plan)
    _, fast = _widened(unit, src, torch.device("cpu"), one_by_one=False)
    _, slow = _widened(unit, src, torch.device("cpu"), one_by_one=True)
    for rec, a, b in zip(unit.tensors, fast, slow):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), rec.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("segments", [64, 2])  # one launch, and several (chunks of two tensors)
@pytest.mark.parametrize("block", [Mixed, Even])  # ragged rows (masked loads) and rows of 16s (16-byte ones)
def test_batched_widening_on_cuda_equals_the_eager_one_bit_for_bit(monkeypatch, segments, block):
    from diffsynth_core.offload import widen_cuda

    monkeypatch.setattr(widening, "SEGMENTS", segments)
    cuda = torch.device("cuda")
    plan = _plan(block=block)
    unit, src = plan.units[0], _stored_bytes(plan).to(cuda)
    batched = UnitWidening(unit, cuda)
    assert all(table.aligned == (block is Even) for *_, table in batched.groups)
    assert batched.groups and sum(len(ids) for *_, ids, _ in batched.groups) == sum(r.quantized for r in unit.tensors)
    launched = []
    real = widen_cuda.widen_segments
    monkeypatch.setattr(widen_cuda, "widen_segments", lambda *a: launched.append(real(*a)) or launched[-1])
    _, fast = _widened(unit, src, cuda, one_by_one=False)
    assert launched and all(launched)  # the kernel ran (an H200 compiles it)
    monkeypatch.setattr(widen_cuda, "widen_rows", lambda *a: False)  # PyTorch's eager widening
    _, eager = _widened(unit, src, cuda, one_by_one=True)
    for rec, a, b in zip(unit.tensors, fast, eager):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), rec.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_kernel_that_does_not_compile_falls_back_to_the_eager_widening_with_one_warning(monkeypatch):
    from diffsynth_core.offload import widen_cuda

    class Uncompilable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no fp8 conversion on this GPU")  # what Triton raises at compile time
            return launch
    monkeypatch.setattr(widen_cuda.kernels(), "widen_segments", Uncompilable())
    monkeypatch.setattr(widen_cuda, "_unsupported", set())
    cuda = torch.device("cuda")
    plan = _plan()
    unit, src = plan.units[0], _stored_bytes(plan).to(cuda)
    with pytest.warns(RuntimeWarning, match="does not compile here") as caught:
        _, fallback = _widened(unit, src, cuda, one_by_one=False)
        _, again = _widened(unit, src, cuda, one_by_one=False)  # no second warning: remembered
    assert len(caught) == 1
    monkeypatch.setattr(widen_cuda, "_unsupported", set())
    monkeypatch.setattr(widen_cuda, "widen_rows", lambda *a: False)
    _, eager = _widened(unit, src, cuda, one_by_one=True)
    for rec, a, b, c in zip(unit.tensors, fallback, again, eager):
        assert torch.equal(a.view(torch.int16), c.view(torch.int16)) and torch.equal(b.view(torch.int16), c.view(torch.int16)), rec.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("storage", [FP8, "packed_bfloat16"])
def test_a_streamers_widening_replays_as_a_cuda_graph_over_what_its_buffers_hold_now(storage):
    """A streamer's widening (``graphs=True``) runs eagerly once per (source, destination) pair,
    is recorded at the second run and replayed after: the same bits as the eager widening every
    time, of whatever the source holds then (fp8: another model's bytes of the same layout), into a
    destination cleared in between; a new destination starts over eagerly."""
    cuda = torch.device("cuda")
    plans = [build_plan(_model(seed, Even), torch.device("cpu"), "block", None, False, storage) for seed in (0, 1)]
    unit = plans[0].units[0]
    stored = [_stored_bytes(plan).to(cuda) for plan in plans]
    if storage != FP8:  # packed: the escape table's size follows the values; one model's bytes
        stored[1] = stored[0]
    expected = []
    for data in stored:
        dst = torch.zeros(unit.dev_bytes, dtype=torch.uint8, device=cuda)
        widen_each(unit, data, [typed_view(dst, r.dev_offset, r.compute_dtype, r.shape) for r in unit.tensors])
        expected.append(dst)
    batched = UnitWidening(unit, cuda, graphs=True)
    src = torch.empty_like(stored[0])
    dsts = [torch.empty(unit.dev_bytes, dtype=torch.uint8, device=cuda) for _ in range(2)]
    got, kinds = [], []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for which, d in ((0, 0), (0, 0), (1, 0), (0, 0), (1, 1), (0, 1), (1, 1)):
            src.copy_(stored[which])
            dst = dsts[d]
            dst.zero_()
            batched.run(src, dst, [typed_view(dst, r.dev_offset, r.compute_dtype, r.shape) for r in unit.tensors])
            got.append((which, dst.clone()))
            kinds.append(type(batched.graphs[(src.data_ptr(), dst.data_ptr())]).__name__)
    torch.cuda.synchronize()
    assert kinds == ["object", "CUDAGraph", "CUDAGraph", "CUDAGraph", "object", "CUDAGraph", "CUDAGraph"]
    for which, out in got:
        # every tensor as the eager widening gives it (not the padding between tensors: the batched
        # copy of the leading plain tensors brings the source's padding along, which nothing reads)
        for rec in unit.tensors:
            n = rec.numel * rec.compute_dtype.itemsize
            assert torch.equal(out[rec.dev_offset:rec.dev_offset + n],
                               expected[which][rec.dev_offset:rec.dev_offset + n]), rec.shape
        # a replay writes what the eager first run wrote, padding included
        assert torch.equal(out, next(first for w, first in got if w == which))

