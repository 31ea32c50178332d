"""Every weight is managed exactly once, odd tensors keep working, detach restores the model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from diffsynth_core.offload import OffloadTrainingManager
from offload_tiny import ToyStack, add_lora, out_tensor, tiny_dit


def _snapshot(model):
    return {k: (v.clone(), v.device, v.dtype) for k, v in model.state_dict().items()}


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_each_parameter_is_managed_once_and_shared_ones_stay_resident():
    model = ToyStack()
    model.blocks[3].up.weight = model.blocks[1].up.weight  # tied across two units
    model.blocks[4].norm.weight = model.scale  # shared between a unit and the root
    model.requires_grad_(False)
    mgr = OffloadTrainingManager(model, "cpu")
    streamed = [id(r.param) for u in mgr.plan.units for r in u.tensors]
    resident = [id(p) for p, _ in mgr.plan.resident_params]
    assert len(streamed) == len(set(streamed))
    assert not set(streamed) & set(resident)
    assert set(streamed) | set(resident) == {id(p) for p in model.parameters()}
    assert id(model.blocks[1].up.weight) in resident and id(model.scale) in resident
    with torch.no_grad():
        model(torch.randn(2, 16))
    mgr.detach()


def test_state_dict_while_attached_and_after_detach_equals_original():
    torch.manual_seed(0)
    model = add_lora(ToyStack(), ["up"])
    before = _snapshot(model)
    hooks = _hook_count(model)
    mgr = OffloadTrainingManager(model, "cpu", poison_evicted=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        model(x)  # some units are now in slots, others on the host
    during = model.state_dict()
    assert during.keys() == before.keys()
    for k, (v, _, _) in before.items():
        if k != "calls":
            assert torch.equal(during[k], v), k
    mgr.after_backward()
    mgr.detach()
    assert _hook_count(model) == hooks
    after = model.state_dict()
    for k, (v, dev, dt) in before.items():
        if k == "calls":
            assert after[k].item() == 1  # the in-place update of the buffer survived
            continue
        assert torch.equal(after[k], v) and after[k].device == dev and after[k].dtype == dt, k
    with pytest.raises(RuntimeError, match="detached"):
        mgr.after_backward()


def test_attach_twice_raises_and_reattach_after_detach_works():
    model = ToyStack().requires_grad_(False)
    mgr = OffloadTrainingManager(model, "cpu")
    with pytest.raises(RuntimeError, match="already attached"):
        OffloadTrainingManager(model, "cpu")
    mgr.detach()
    OffloadTrainingManager(model, "cpu").detach()


def test_mutable_buffers_keep_their_updates():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(3)])
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(3)])
    ref.load_state_dict(model.state_dict())
    model.requires_grad_(False)
    mgr = OffloadTrainingManager(model, "cpu", poison_evicted=True)
    for seed in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(model(x), ref(x))
        mgr.after_backward()
    mgr.detach()
    for (k, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k


def test_wan_root_parameter_and_inference_while_attached():
    model, names, kwargs = tiny_dit("wan")
    with torch.no_grad():
        ref = out_tensor(model(**kwargs))
    mgr = OffloadTrainingManager(model, "cpu", block_container_names=names, poison_evicted=True)
    resident = {id(p) for p, _ in mgr.plan.resident_params}
    assert id(model.scale_shift_table) in resident
    with torch.no_grad():
        for _ in range(2):  # repeated inference re-uses the learned order
            assert torch.equal(out_tensor(model(**kwargs)), ref)
    assert len(mgr.loaded_units()) <= 2
    mgr.detach()


def test_bad_container_name_is_a_clear_error():
    with pytest.raises(ValueError, match="transformer_blocks"):
        OffloadTrainingManager(ToyStack(), "cpu", block_container_names=("transformer_blocks",))
    with pytest.raises(ValueError, match="granularity"):
        OffloadTrainingManager(ToyStack(), "cpu", granularity="layer")
    with pytest.raises(ValueError, match="prefetch"):
        OffloadTrainingManager(ToyStack(), "cpu", prefetch=-1)


class _Nested(nn.Module):
    """blocks -> (attn: 2 Linear(16,16), mlp: Sequential(Linear(16,64), Linear(64,16))) + a direct table."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            attn=nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)]),
            mlp=nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)))) for _ in range(2))
        for b in self.blocks:
            b.table = nn.Parameter(torch.ones(16))  # owned by the block itself, read in its forward

    def forward(self, x):
        for b in self.blocks:
            x = x * b.table + b.attn[1](b.attn[0](x))
            x = x + b.mlp(x)
        return x


def test_split_threshold_splits_units_over_it_in_bytes_recursively():
    model = _Nested().requires_grad_(False)
    x = torch.randn(3, 16)
    ref = model(x)
    linear16 = (16 * 16 + 16) * 4  # 1088 bytes; attn 2176; mlp Linears 4352 + 4160; a block 10752
    cases = {None: {"blocks.0", "blocks.1"},
             10_000 / 2**20: {"blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"},
             2.5 * linear16 / 2**20: {"blocks.0.attn", "blocks.0.mlp.0", "blocks.0.mlp.2",
                                      "blocks.1.attn", "blocks.1.mlp.0", "blocks.1.mlp.2"},
             1.0 / 2**20: {f"blocks.{b}.{m}" for b in (0, 1) for m in ("attn.0", "attn.1", "mlp.0", "mlp.2")}}
    for threshold_mb, names in cases.items():
        mgr = OffloadTrainingManager(model, "cpu", cpu_offload_split_threshold=threshold_mb)
        assert {u.name for u in mgr.plan.units} == names, threshold_mb
        if threshold_mb is not None:  # the split block's own table is left out of the units: resident
            assert {id(b.table) for b in model.blocks} <= {id(p) for p, _ in mgr.plan.resident_params}
        with torch.no_grad():
            assert torch.equal(model(x), ref)
        mgr.detach()
    with pytest.raises(ValueError, match="cpu_offload_split_threshold"):
        OffloadTrainingManager(model, "cpu", cpu_offload_split_threshold=0)


def test_split_units_under_a_budget_warn_when_their_slots_hold_less_than_two_blocks():
    import warnings
    model = _Nested().requires_grad_(False)
    layers = 1.0 / 2**20  # every Linear its own unit: the largest (mlp.0) 4352 bytes, a block 10752
    with pytest.warns(RuntimeWarning, match=r"2 slots of .* offload.prefetch = 4 keeps two blocks"):
        mgr = OffloadTrainingManager(model, "cpu", cpu_offload_split_threshold=layers, vram_budget_gb=1e-3)
    mgr.detach()
    quiet = (dict(cpu_offload_split_threshold=layers, prefetch=4, vram_budget_gb=1e-3),  # slots enough
             dict(cpu_offload_split_threshold=layers, prefetch=1),  # no budget: small slots are the point
             dict(cpu_offload_split_threshold=1.0, prefetch=0, vram_budget_gb=1e-3))  # nothing split
    for opts in quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            OffloadTrainingManager(model, "cpu", **opts).detach()


def test_fp8_storage_has_per_row_scales_streams_fewer_bytes_and_widens_exactly():
    from diffsynth_core.offload.quant import dequantize_rows, quantize_rows
    torch.manual_seed(0)
    model = ToyStack(d=64).requires_grad_(False)
    for blk in model.blocks:  # rows of very different magnitudes: one scale per tensor would fail them
        blk.up.weight.data[::2] *= 1e-3
    original = model.blocks[0].up.weight.data.clone()
    ref = ToyStack(d=64)
    ref.load_state_dict(model.state_dict())
    for blk in ref.blocks:  # what fp8 storage does: 2-D weights quantized per row, the rest kept
        for p in blk.parameters():
            if p.dim() == 2:
                p.data = dequantize_rows(*quantize_rows(p.data, torch.float8_e4m3fn), torch.float32)
    full = sum(p.numel() * 4 for blk in model.blocks for p in blk.parameters())
    mgr = OffloadTrainingManager(model, "cpu", storage_dtype=torch.float8_e4m3fn)
    assert mgr.report()["arena_bytes"] <= 0.3 * full
    row_error = (ref.blocks[0].up.weight.data - original).norm(dim=1) / original.norm(dim=1)
    assert row_error.max() < 0.07  # e4m3 keeps 3 mantissa bits in every row, the 1e-3 ones too
    assert original[::2].to(torch.float8_e4m3fn).float().abs().max() < 1e-3 * original.abs().max()  # unscaled: gone
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    mgr.detach()
    for (k, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b) and a.dtype == b.dtype, k  # detach gives back the widened values


def test_no_warning_filters_and_no_cuda_calls_on_cpu():
    code = (
        "import warnings, torch; before = list(warnings.filters)\n"
        "import diffsynth_core.offload, diffsynth_core.gradient\n"
        "from diffsynth_core.offload import OffloadTrainingManager\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)]).requires_grad_(False)\n"
        "mgr = OffloadTrainingManager(m, 'cpu'); m(torch.randn(2, 4)); mgr.after_backward(); mgr.detach()\n"
        "assert list(warnings.filters) == before, 'warning filters changed'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
    )
    subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], check=True)
