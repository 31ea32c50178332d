"""Training with the engine equals training without it, bitwise on CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.offload import OffloadTrainingManager
from offload_tiny import ToyStack, add_lora, budget_for, out_tensor, tiny_dit, train


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert len(la) == len(lb) >= 3
    for x, y in zip(la, lb):
        assert torch.equal(x, y), (x, y)
    for step_a, step_b in zip(ga, gb):
        assert len(step_a) == len(step_b) > 0
        for x, y in zip(step_a, step_b):
            assert torch.equal(x, y)


def _toy(seed=0):
    torch.manual_seed(seed)
    return add_lora(ToyStack(), ["up", "down", "head"])


def _toy_run(engine: bool, checkpoint: bool, **opts):
    opts = dict(opts)
    model = _toy()
    if checkpoint:
        apply_gradient_checkpointing(model, ("blocks",))
    if opts.pop("budget_units", None):  # room for two of the five blocks: planned at step 2
        unit = sum(p.numel() * 4 for p in model.blocks[0].parameters() if not p.requires_grad)
        opts["vram_budget_gb"] = budget_for(model, 2 * unit)
    mgr = OffloadTrainingManager(model, "cpu", poison_evicted=True, **opts) if engine else None
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    result = train(model, 3, lambda s, m: model(x + s).pow(2).mean(), mgr)
    return result, model, mgr


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("opts", [dict(), dict(granularity="leaf"), dict(prefetch=0), dict(prefetch=3),
                                  dict(budget_units=2), dict(storage_dtype=torch.float32, cpu_offload_split_threshold=1e-3)],
                         ids=["block", "leaf", "p0", "p3", "budget", "split"])
def test_toy_lora_training_is_bitwise_identical(checkpoint, opts):
    ref, ref_model, _ = _toy_run(False, checkpoint)
    got, model, mgr = _toy_run(True, checkpoint, **opts)
    _assert_same(ref, got)
    if opts.get("budget_units"):
        assert mgr.report()["budget_units"] == 2
    if opts.get("cpu_offload_split_threshold"):
        assert "blocks.0.up.base_layer" in {u.name for u in mgr.plan.units}
    mgr.detach()
    for (k, a), (_, b) in zip(ref_model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_tiny_dit_lora_training_is_bitwise_identical(family, checkpoint):
    runs = []
    for engine in (False, True):
        model, names, kwargs = tiny_dit(family)
        if checkpoint:
            apply_gradient_checkpointing(model, names)
        mgr = (OffloadTrainingManager(model, "cpu", block_container_names=names, poison_evicted=True)
               if engine else None)
        runs.append(train(model, 3, lambda s, m: out_tensor(model(**kwargs)).pow(2).mean(), mgr))
        if mgr is not None:
            assert mgr.report()["streamed_units"] == len([b for n in names for b in getattr(model, n)])
            mgr.detach()
    _assert_same(*runs)


def test_diffusers_own_gradient_checkpointing_composes_with_the_engine():
    runs = []
    for engine in (False, True):
        model, names, kwargs = tiny_dit("flux")
        model.enable_gradient_checkpointing()  # block calls happen inside the checkpoint here
        mgr = (OffloadTrainingManager(model, "cpu", block_container_names=names, poison_evicted=True)
               if engine else None)
        runs.append(train(model, 3, lambda s, m: out_tensor(model(**kwargs)).pow(2).mean(), mgr))
        if mgr is not None:
            assert mgr.unit_loads[0]["B"] <= 3  # the recompute reuses the backward copy
            mgr.detach()
    _assert_same(*runs)
