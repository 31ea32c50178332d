"""Two experts in one run (training/experts.py) on toy DiTs: routing, what each expert learns, resume,
and sigmas drawn within a range (one expert per run)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from diffsynth_core.errors import InputError
from diffsynth_core.models.base import Expert
from diffsynth_core.training.experts import ExpertModels, predict, select_experts, trained_sigma_range
from diffsynth_core.training.flow_matching import diffsynth_sigmas, sample_sigmas
from diffsynth_core.training.loop import Trainer
from diffsynth_core.training.prepare import prepare_for_training
from stages.config import OffloadSection, TrainSection

from .toy import TOY_PADDED_SPEC, TOY_SPEC, ToyDiT, lora_of, mixed_toy_samples

HIGH, LOW = Expert("transformer", 0.6, 1.0, "high_noise"), Expert("transformer_2", 0.0, 0.6, "low_noise")
TWO_EXPERTS = replace(TOY_PADDED_SPEC, experts=(HIGH, LOW))  # batches of 2 pad their prompts


def _experts(seed=0):
    torch.manual_seed(seed)
    return ExpertModels((HIGH, LOW), {"transformer": ToyDiT(), "transformer_2": ToyDiT()})


def test_a_mixed_batch_runs_each_sample_through_its_own_expert_in_batch_order():
    model = _experts()
    latents, text = torch.randn(4, 4, 4, 4), torch.randn(4, 3, 4)
    sigmas = torch.tensor([0.9, 0.1, 0.6, 0.59])  # 0.6 is the boundary: the high-noise expert's
    with torch.no_grad():
        got = predict(TOY_SPEC.dit_forward, model, latents, sigmas, {"prompt_embeds": text})
        for i, owner in enumerate([model.transformer, model.transformer_2, model.transformer, model.transformer_2]):
            alone = owner(latents[i:i + 1], sigmas[i:i + 1], text[i:i + 1])
            assert torch.allclose(got[i:i + 1], alone, atol=1e-6), i
    assert model.take_ran() == {"transformer", "transformer_2"}


def _train(tmp_path, model, samples=None, sigma_range=None, offload=None, **options):
    defaults = dict(lora_rank=4, max_steps=6, save_steps=2, learning_rate=1e-2, seed=5, gradient_checkpointing=True,
                    batch_size=2)
    train = TrainSection(**{**defaults, **options})
    trainer = Trainer(TWO_EXPERTS, model, samples or mixed_toy_samples(), train, offload or OffloadSection(), tmp_path,
                      progress=False, sigma_range=sigma_range)
    return trainer.fit()


def test_each_expert_learns_only_from_its_sigmas(tmp_path):
    base = _experts()
    initial = prepare_for_training(copy.deepcopy(base), TWO_EXPERTS, TrainSection(lora_rank=4, seed=5),
                                   OffloadSection(), torch.device("cpu"))
    before = lora_of(initial.model)  # the LoRA as initialised, before any step
    # every sigma drawn above the boundary: the low-noise expert's LoRA never moves
    high_only = _train(tmp_path / "high", copy.deepcopy(base), sigma_range=(0.7, 1.0)).model
    after = lora_of(high_only)
    moved = {name.split(".")[0] for name in after if not torch.equal(after[name], before[name])}
    assert moved == {"transformer"}
    # both: each expert's LoRA moves, and the checkpoint holds both
    both = _train(tmp_path / "both", copy.deepcopy(base)).model
    after = lora_of(both)
    assert {name.split(".")[0] for name in after if not torch.equal(after[name], before[name])} == {
        "transformer", "transformer_2"}


def test_two_experts_stop_and_resume_bit_for_bit(tmp_path):
    base = _experts(1)
    straight = _train(tmp_path / "straight", copy.deepcopy(base), max_steps=6)
    _train(tmp_path / "resumed", copy.deepcopy(base), max_steps=2)  # "killed" after step 2's checkpoint
    resumed = _train(tmp_path / "resumed", copy.deepcopy(base), max_steps=6)
    assert resumed.resumed_from == 2
    expected, got = lora_of(straight.model), lora_of(resumed.model)
    assert {n.split(".")[0] for n in expected} == {"transformer", "transformer_2"}
    assert all(torch.equal(expected[n], got[n]) for n in expected)


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "shift", "diffsynth"])
def test_sigmas_drawn_in_a_range_stay_in_it_and_follow_the_cut_distribution(scheme):
    g = torch.Generator().manual_seed(0)
    sigmas = sample_sigmas(4000, scheme, g, template="Wan", sigma_range=(0.3, 0.8))
    assert sigmas.dtype == torch.float32 and float(sigmas.min()) >= 0.3 and float(sigmas.max()) <= 0.8
    full = sample_sigmas(200_000, scheme, torch.Generator().manual_seed(1), template="Wan")
    cut = full[(full >= 0.3) & (full <= 0.8)]
    assert abs(float(sigmas.mean()) - float(cut.mean())) < 0.01  # the uncut distribution, conditioned


def test_diffsynth_timestep_boundaries_are_the_grid_points_in_the_sigma_range():
    """DiffSynth draws index randint(min_b * 1000, max_b * 1000) of its grid; the sigma range
    [grid[max_b * 1000 - 1], grid[min_b * 1000]] holds exactly those points."""
    grid = diffsynth_sigmas("Wan")
    low, high = float(grid[416]), float(grid[0])  # --max_timestep_boundary 0.417 --min_timestep_boundary 0
    drawn = sample_sigmas(5000, "diffsynth", torch.Generator().manual_seed(0), template="Wan", sigma_range=(low, high))
    assert set(drawn.tolist()) == set(grid[:417].tolist())


def test_the_sigma_range_selects_the_experts_it_reaches():
    assert select_experts(TWO_EXPERTS, None, (0.0, 1.0)) == (HIGH, LOW)
    assert select_experts(TWO_EXPERTS, None, (0.7, 1.0)) == (HIGH,)
    assert select_experts(TWO_EXPERTS, ["transformer_2"], None) == (LOW,)
    assert trained_sigma_range((LOW,), (0.0, 1.0)) == (0.0, 0.6)
    with pytest.raises(InputError, match="train.experts \\['transformer_3'\\]"):
        select_experts(TWO_EXPERTS, ["transformer_3"], None)
    with pytest.raises(InputError, match="leaves no sigma"):
        trained_sigma_range((LOW,), (0.7, 1.0))


def test_two_experts_under_the_offload_engine_train_as_without_it(tmp_path):
    base = _experts(2)
    plain = lora_of(_train(tmp_path / "plain", copy.deepcopy(base), max_steps=4).model)
    result = _train(tmp_path / "offload", copy.deepcopy(base), max_steps=4,
                    offload=OffloadSection(enable_model_cpu_offload=True))
    streamed = lora_of(result.model)
    result.offload.detach()
    assert streamed.keys() == plain.keys() and all(torch.equal(streamed[k], plain[k]) for k in plain)


def test_only_the_active_expert_streams(tmp_path):
    torch.manual_seed(0)
    model = ExpertModels((HIGH, LOW), {"transformer": ToyDiT(depth=4), "transformer_2": ToyDiT(depth=4)})
    result = _train(tmp_path, model, max_steps=4, save_steps=0, sigma_range=(0.7, 1.0),
                    offload=OffloadSection(enable_model_cpu_offload=True))  # 2 slots for 8 blocks
    manager = result.offload
    loads = {u.name: sum(manager.unit_loads[u.index].values()) for u in manager.plan.units}
    manager.detach()
    high = sum(n for name, n in loads.items() if name.startswith("transformer."))
    low = sum(n for name, n in loads.items() if name.startswith("transformer_2."))
    assert high >= 4 * 4 and low <= 1  # the idle expert: at most the first step's guess at what follows


def test_the_budget_keeps_81_frames_of_a_40_block_14b_model_in_host_memory_and_ti2v_on_the_gpu():
    """What "auto" activation offload chooses at the issue's sizes (no GPU needed: shapes on meta)."""
    from diffsynth_core.models import get_family
    from diffsynth_core.training.prepare import activations_need_host, checkpointed_input_bytes

    spec = get_family("wan")
    cuda, budget = torch.device("cuda"), OffloadSection(enable_model_cpu_offload=True, vram_budget_gb=24)
    train = TrainSection(lora_rank=32)
    a14b = spec.build_transformer("Wan2.2-T2V-A14B", torch.bfloat16, "meta")
    wan_81 = (16, 21, 60, 104)  # 81 frames at 480x832 through the 8x VAE
    assert checkpointed_input_bytes(a14b, spec, 1, wan_81) == 40 * 21 * 30 * 52 * 5120 * 2  # 13.4 GB
    assert activations_need_host(train, budget, cuda, a14b, spec, wan_81)
    ti2v = spec.build_transformer("Wan2.2-TI2V-5B", torch.bfloat16, "meta")
    assert not activations_need_host(train, budget, cuda, ti2v, spec, (48, 31, 44, 80))  # 121 x 704x1280: 5.0 GB
    # without a budget, on the CPU, or when the key is set, "auto" decides nothing
    assert not activations_need_host(train, OffloadSection(enable_model_cpu_offload=True), cuda, a14b, spec, wan_81)
    assert not activations_need_host(train, budget, torch.device("cpu"), a14b, spec, wan_81)
    assert not activations_need_host(TrainSection(gradient_checkpointing_offload=False), budget, cuda, a14b, spec,
                                     wan_81)


@pytest.mark.parametrize("on_host", [False, True])
def test_a_budget_too_small_for_inputs_kept_on_the_gpu_says_they_can_go_to_host_memory(on_host):
    """A14B at 81 frames keeps 13.4 GB of checkpointed inputs: with them on the GPU a 24 GiB budget cannot
    hold the step, and the line that says so names the key that moves them to host memory."""
    from diffsynth_core.offload.budget import GIB

    train = TrainSection(lora_rank=4, seed=5, gradient_checkpointing=True, gradient_checkpointing_offload=on_host)
    offload = OffloadSection(enable_model_cpu_offload=True, vram_budget_gb=1.0)
    prepared = prepare_for_training(_experts(), TWO_EXPERTS, train, offload, torch.device("cpu"))
    tracker = prepared.offload.budget
    tracker.first_peak, tracker.start_allocated = 2 * GIB, 0  # a step measured at twice the budget
    tracker.memory.allocated = lambda: 0
    with pytest.raises(InputError) as refused:
        tracker.room()
    line = str(refused.value)
    assert ("train.gradient_checkpointing_offload = true" in line) is not on_host
    assert "cannot hold one training step" in line and "raise the budget" in line
    prepared.offload.detach()
