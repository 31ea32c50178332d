"""Bounded residency at every op of forward and backward, and minimal, counted traffic."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.offload import OffloadTrainingManager
from diffsynth_core.offload.budget import simulate_loads
from offload_tiny import ToyStack, add_lora, budget_for, out_tensor, tiny_dit


class ResidencyProbe(TorchDispatchMode):
    """Records how many streamed units are on the device at every aten op (forward and backward)."""

    def __init__(self, mgr):
        super().__init__()
        self.mgr, self.counts = mgr, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.append(len(self.mgr.loaded_units()))
        return func(*args, **(kwargs or {}))


def _step(model, mgr, loss_fn):
    with ResidencyProbe(mgr) as probe:
        loss_fn().backward()
    mgr.after_backward()
    # Only frozen units still in their slots survive the step (the next forward starts with them).
    assert len(mgr.loaded_units()) <= len(mgr.streamer.slots)
    assert all(not r.trainable for u in mgr.streamer.loaded_units() for r in u.tensors)
    return probe.counts


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_residency_is_bounded_by_prefetch_plus_one(prefetch, checkpoint):
    torch.manual_seed(0)
    model = add_lora(ToyStack(n=6), ["up"])
    if checkpoint:
        apply_gradient_checkpointing(model, ("blocks",))
    mgr = OffloadTrainingManager(model, "cpu", prefetch=prefetch)
    x = torch.randn(4, 16)
    for _ in range(3):
        counts = _step(model, mgr, lambda: model(x).sum())
        assert counts and max(counts) <= prefetch + 1
    mgr.detach()


def test_budget_units_stay_and_do_not_count_against_the_window():
    torch.manual_seed(0)
    model = add_lora(ToyStack(n=6), ["up"])
    unit_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters() if not p.requires_grad)
    mgr = OffloadTrainingManager(model, "cpu", vram_budget_gb=budget_for(model, 3.5 * unit_bytes))
    assert mgr.report()["budget_units"] == 0  # the first step runs everything streamed, and is measured
    _step(model, mgr, lambda: model(torch.randn(4, 16)).sum())
    counts = _step(model, mgr, lambda: model(torch.randn(4, 16)).sum())
    rep = mgr.report()
    assert rep["budget_units"] == 3 and rep["streamed_units"] == 3
    # Chosen among the units that cost two copies a step, spread over them evenly; blocks 1 and 5
    # cost one (the slots keep them across the backward->forward and forward->backward turns;
    # blocks[0] runs twice a forward, so it is copied twice too).
    assert {u.index for u in mgr.plan.budget} == {0, 3, 4}
    assert max(counts) <= 2
    for _ in range(2):  # planned bytes per step = measured bytes per step
        _step(model, mgr, lambda: model(torch.randn(4, 16)).sum())
        assert rep["planned_h2d_bytes_per_step"] == mgr.report()["last_step_h2d_bytes"] > 0
    mgr.detach()


def test_leaf_units_with_gradient_free_outputs_in_checkpointed_blocks_are_released():
    # Qwen-Image's img_mod/txt_mod Linears read only the (frozen) time embedding: their outputs need
    # no gradient, so no backward hook ever fires for them; the reference engine leaks them.
    model, names, kwargs = tiny_dit("qwen_image")
    apply_gradient_checkpointing(model, names)
    mgr = OffloadTrainingManager(model, "cpu", block_container_names=names, granularity="leaf", prefetch=2)
    mods = {u.name for u in mgr.plan.streamed}
    assert "transformer_blocks.0.img_mod.1.base_layer" in mods and "transformer_blocks.0.txt_mod.1" in mods
    for _ in range(2):
        counts = _step(model, mgr, lambda: out_tensor(model(**kwargs)).sum())
        assert max(counts) <= 3
    mgr.detach()


def test_each_unit_is_copied_at_most_once_per_phase_with_checkpointing():
    model, names, kwargs = tiny_dit("flux")
    apply_gradient_checkpointing(model, names)
    mgr = OffloadTrainingManager(model, "cpu", block_container_names=names, prefetch=1)
    n = len(mgr.plan.streamed)
    order = [u.index for u in mgr.plan.streamed]
    size = {u.index: u.host_bytes for u in mgr.plan.streamed}
    for step in range(3):
        before = {i: dict(c) for i, c in mgr.unit_loads.items()}
        bytes_before = mgr.report()["h2d_bytes"]
        _step(model, mgr, lambda: out_tensor(model(**kwargs)).sum())
        for i, c in mgr.unit_loads.items():
            assert c["F"] - before[i]["F"] <= 1 and c["B"] - before[i]["B"] <= 1, (step, i)
        # Blocks run in list order (seeded, then learned), from the first step on: the units in the
        # slots at the forward->backward turn are not reloaded, nor, from the second step on, those
        # left there by the backward for the next forward.
        copied = mgr.report()["h2d_bytes"] - bytes_before
        uses = order + order[::-1]
        loads = simulate_loads(uses, order, 2, set(order), steps=step + 1)
        assert copied == sum(k * size[i] for i, k in loads.items())
        assert copied == (2 * sum(size.values()) - sum(size[i] for i in order[-2:])
                          - (sum(size[i] for i in order[:2]) if step else 0))
    assert mgr.report()["h2d_copies"] <= 3 * 2 * n
    mgr.detach()


def test_modules_called_several_times_stay_bounded():
    torch.manual_seed(0)
    model = add_lora(ToyStack(n=3), ["up"])  # blocks[0] runs twice per forward
    mgr = OffloadTrainingManager(model, "cpu", prefetch=1, granularity="leaf")
    for _ in range(2):
        counts = _step(model, mgr, lambda: model(torch.randn(2, 16)).sum())
        assert max(counts) <= 2
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert len(mgr.loaded_units()) <= 2
    mgr.detach()


def test_forwards_without_gradients_prefetch_on_every_call():
    """Stage 1 streams its text encoders through calls without gradients: each call must find the order the
    last one learned, so every block's copy starts ahead of its use (on CUDA: during the previous block's
    compute).  At most the first blocks of a call are loaded when used: nothing links one call to the next."""
    torch.manual_seed(0)
    model = ToyStack(n=6).requires_grad_(False)
    mgr = OffloadTrainingManager(model, "cpu", prefetch=1)
    x = torch.randn(4, 16)
    per_call = []
    with torch.no_grad():
        for _ in range(4):
            before = mgr.stats["demand_loads"]
            out = model(x)
            per_call.append(mgr.stats["demand_loads"] - before)
    assert per_call[1:] == [per_call[1]] * 3 and per_call[1] <= 2, per_call
    mgr.detach()
    with torch.no_grad():
        assert torch.equal(model(x), out)
