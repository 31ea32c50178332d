"""Lossless 12-bit storage of bf16 weights (``storage_dtype="packed_bfloat16"``): every bit comes
back, in the codec and through the engine, and training is bitwise what it is without the engine."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.errors import InputError
from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.offload import OffloadTrainingManager
from diffsynth_core.offload import packed
from offload_tiny import ToyStack, add_lora, budget_for, train

PACKED = packed.PACKED


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _awkward(shape=(37, 41)) -> torch.Tensor:
    """A bf16 weight with what a window of binades does not cover: zeros of both signs, subnormals,
    infinities, a NaN, huge and tiny values."""
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    flat = w.view(-1)
    specials = [0.0, -0.0, 1e-40, -3e-39, float("inf"), float("-inf"), float("nan"), 1e30, -1e-30, 448.0]
    n = min(len(specials), flat.numel())
    flat[:n] = torch.tensor(specials[:n]).bfloat16()
    return w


@pytest.mark.parametrize("weight", [
    _awkward(),
    _awkward((1, 1)),
    (torch.rand(64, 33, generator=torch.Generator().manual_seed(1)) * 2 - 1).bfloat16() / 64,  # odd count
    torch.zeros(4, 6, dtype=torch.bfloat16),
], ids=["awkward", "one", "uniform_odd", "zeros"])
def test_packing_gives_back_every_bit_of_the_weight(weight):
    base, escapes = packed.choose_base(weight)
    lows, nibbles, positions, bits = packed.pack(weight, base)
    assert positions.numel() == escapes
    assert lows.shape == weight.shape and nibbles.numel() == packed.nibble_bytes(weight.numel())
    assert torch.equal(_bits(packed.decode(lows, nibbles, base, positions, bits)), _bits(weight))


def test_the_window_covers_the_crowded_binades():
    w = (torch.randn(256, 256, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    base, escapes = packed.choose_base(w)
    # Gaussian weights: the window's top binade holds the largest magnitudes, and what falls below
    # it is a fraction of a per mille (2^-13 of the largest and smaller).
    assert base + packed.WINDOW - 1 >= int((_bits(w.abs().max().reshape(1)).int() >> 7) & 0xFF)
    assert escapes < w.numel() / 1000


def _bf16(model: ToyStack) -> ToyStack:
    model.offset = model.offset.bfloat16()  # a plain attribute: .to() leaves it in fp32
    return model.to(torch.bfloat16)


def _bf16_toy(seed: int = 0):
    torch.manual_seed(seed)
    model = add_lora(_bf16(ToyStack(d=64, n=6)), ["up", "down"])
    apply_gradient_checkpointing(model, ("blocks",))
    return model


def _train(model, mgr):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    return train(model, 4, lambda s, m: model(x + s).float().pow(2).mean(), mgr)


def _same(a, b):
    (la, ga), (lb, gb) = a, b
    assert len(la) == len(lb) == 4
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    assert all(torch.equal(x, y) for sa, sb in zip(ga, gb) for x, y in zip(sa, sb))


def test_training_on_packed_weights_is_bitwise_training_without_the_engine():
    reference_model = _bf16_toy()
    frozen = {n: p.detach().clone() for n, p in reference_model.named_parameters() if not p.requires_grad}
    reference = _train(reference_model, None)

    model = _bf16_toy()
    mgr = OffloadTrainingManager(model, "cpu", storage_dtype=PACKED, poison_evicted=True)
    packed_recs = [r for u in mgr.plan.units for r in u.tensors if r.packed]
    assert {r.shape for r in packed_recs} == {torch.Size([128, 64]), torch.Size([64, 128])}
    plain = OffloadTrainingManager(_bf16_toy(), "cpu")
    # 12 bits a weight instead of 16 (biases, norms and the table of escapes stay as they are)
    assert mgr.plan.arena_bytes < 0.8 * plain.plan.arena_bytes
    plain.detach()
    _same(reference, _train(model, mgr))
    mgr.detach()
    for name, p in model.named_parameters():
        if name in frozen:  # the base comes back bit for bit from its packed form
            assert p.dtype == torch.bfloat16 and torch.equal(_bits(p.data), _bits(frozen[name])), name


def test_packed_units_kept_on_the_device_as_stored_train_bitwise_and_copy_less():
    reference = _train(_bf16_toy(), None)
    model = _bf16_toy()
    probe = OffloadTrainingManager(model, "cpu", storage_dtype=PACKED)
    unit = probe.plan.units[1]
    assert unit.host_bytes < 0.8 * unit.dev_bytes
    probe.detach()
    budget = budget_for(model, 3.5 * unit.host_bytes, storage_dtype=PACKED)  # three blocks as stored
    mgr = OffloadTrainingManager(model, "cpu", storage_dtype=PACKED, vram_budget_gb=budget, poison_evicted=True)
    _same(reference, _train(model, mgr))
    report = mgr.report()
    assert report["compact_units"] == 3 and report["device_widenings"] > 0
    assert report["planned_h2d_bytes_per_step"] == report["last_step_h2d_bytes"]
    mgr.detach()


def test_escapes_are_written_back_through_the_engine():
    torch.manual_seed(0)
    model = ToyStack(d=32, n=3).to(torch.bfloat16).requires_grad_(False)
    weight = model.blocks[1].up.weight
    weight.data.view(-1)[:5] = torch.tensor([1e30, -1e-30, float("inf"), 0.0, 3e-39]).bfloat16()
    original = weight.detach().clone()
    mgr = OffloadTrainingManager(model, "cpu", storage_dtype=PACKED, poison_evicted=True)
    unit = next(u for u in mgr.plan.units if u.name == "blocks.1")
    assert unit.escapes >= 3  # 1e30, 1e-30 and inf are far outside the window
    mgr.streamer.load(unit, mgr.streamer.home_slot(unit))
    assert torch.equal(_bits(weight.data), _bits(original))
    mgr.streamer.evict_all()
    mgr.detach()
    assert torch.equal(_bits(weight.data), _bits(original))


def test_weights_whose_exponents_spread_wide_stay_in_bf16():
    torch.manual_seed(0)
    model = ToyStack(d=32, n=2).to(torch.bfloat16).requires_grad_(False)
    spread = torch.randn(64, 32) * torch.exp2(torch.randint(-60, 60, (64, 32)).float())
    model.blocks[0].up.weight.data.copy_(spread.bfloat16())
    mgr = OffloadTrainingManager(model, "cpu", storage_dtype=PACKED)
    recs = {r.param: r for u in mgr.plan.units for r in u.tensors}
    assert not recs[model.blocks[0].up.weight].packed and recs[model.blocks[1].up.weight].packed
    mgr.detach()


def test_an_unknown_storage_name_is_refused_in_one_line():
    with pytest.raises(InputError, match="packed_bfloat16"):
        OffloadTrainingManager(ToyStack(), "cpu", storage_dtype="packed_bf12")


def test_a_model_with_nothing_to_pack_says_so_once():
    with pytest.warns(RuntimeWarning, match="packs frozen bfloat16 weights only; this model's streamed weights are float32"):
        mgr = OffloadTrainingManager(ToyStack().requires_grad_(False), "cpu", storage_dtype=PACKED)
    assert not any(r.packed for u in mgr.plan.units for r in u.tensors)
    mgr.detach()
