import math

import pytest
import torch

from diffsynth_core.training import flow_matching as fm


def test_noisy_latents_and_target_match_hand_computed_values():
    x0 = torch.tensor([[1.0, -2.0]])
    noise = torch.tensor([[0.5, 4.0]])
    sigma = torch.tensor([0.25])
    # x_t = 0.75 * x0 + 0.25 * noise
    assert torch.equal(fm.noisy_latents(x0, noise, sigma), torch.tensor([[0.875, -0.5]]))
    assert torch.equal(fm.velocity_target(x0, noise), torch.tensor([[-0.5, 6.0]]))


def test_loss_is_weighted_fp32_mse_against_hand_computed_example():
    prediction = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.bfloat16)
    target = torch.tensor([[1.0, 3.0], [1.0, 3.0]])
    weights = torch.tensor([1.0, 0.5])
    # per-sample MSE: (1 + 9) / 2 = 5 and (0 + 4) / 2 = 2 -> mean(1*5, 0.5*2) = 3
    assert fm.flow_matching_loss(prediction, target, weights).item() == 3.0


def test_shift_and_weights_follow_their_formulas():
    sigmas = torch.tensor([0.5])
    assert fm.shift_sigmas(sigmas, 3.0).item() == pytest.approx(0.75)
    assert fm.loss_weight(sigmas, "sigma_sqrt").item() == pytest.approx(4.0)
    assert fm.loss_weight(sigmas, "cosmap").item() == pytest.approx(2 / (math.pi * 0.5))
    assert fm.loss_weight(sigmas, "none").item() == 1.0


@pytest.mark.parametrize("scheme", [s for s in fm.SAMPLING_SCHEMES if s != "diffsynth"])
def test_sampling_is_seeded_full_precision_and_in_range(scheme):
    draw = lambda: fm.sample_sigmas(4096, scheme, torch.Generator().manual_seed(3), num_tokens=1024)
    first, second = draw(), draw()
    assert torch.equal(first, second) and first.dtype == torch.float32
    assert 0.0 <= first.min() and first.max() <= 1.0
    # full precision: far more distinct values than the reference's 376 reachable timesteps
    assert first.unique().numel() > 4000


# --- DiffSynth-Studio's schedule, checked against its formulas worked out by hand ---------------
# Source: DiffSynth-Studio diffsynth/diffusion/flow_match.py, FlowMatchScheduler.set_timesteps_{flux,wan,
# qwen_image}(num_inference_steps=1000) and set_training_weight(), as training_module.py calls them.

def _qwen_point(s):  # exp(mu) / (exp(mu) + 1/s - 1), mu = 0.8, then 1 - (1 - z) / scale with the last point -> 0.02
    z = lambda s: math.exp(0.8) / (math.exp(0.8) + 1 / s - 1)
    scale = (1 - z(1 / 1000)) / (1 - 0.02)
    return 1 - (1 - z(s)) / scale


@pytest.mark.parametrize("template, first, middle, last", [
    # FLUX.1: linspace(1, 0.003/1.002, 1000), shift 3: 3s/(1+2s); the last point is 0.009/1.008 = 1/112
    ("FLUX.1", 1.0, (lambda s: 3 * s / (1 + 2 * s))(1 - 500 * (1 - 0.003 / 1.002) / 999), 1 / 112),
    # Wan: linspace(1, 0, 1001)[:-1] (1 .. 0.001), shift 5: 5s/(1+4s)
    ("Wan", 1.0, 5 * 0.5 / (1 + 4 * 0.5), 5 * 0.001 / (1 + 4 * 0.001)),
    # Qwen-Image: the same open grid, exponential shift mu = 0.8, shift_terminal 0.02
    ("Qwen-Image", 1.0, _qwen_point(0.5), 0.02),
    # Z-Image (set_timesteps_z_image): Wan's open grid, shift 3: 3s/(1+2s)
    ("Z-Image", 1.0, 3 * 0.5 / (1 + 2 * 0.5), 3 * 0.001 / (1 + 2 * 0.001)),
    # FLUX.2 (set_timesteps_flux2, no length): linspace(1, 1/1000, 1000), exponential shift mu = 0.8, no terminal
    ("FLUX.2", 1.0, math.exp(0.8) / (math.exp(0.8) + 1), math.exp(0.8) / (math.exp(0.8) + 999)),
])
def test_diffsynth_sigma_grid_matches_hand_computed_points(template, first, middle, last):
    grid = fm.diffsynth_sigmas(template)
    assert grid.shape == (1000,) and grid.dtype == torch.float32
    assert bool((grid[1:] < grid[:-1]).all())  # strictly decreasing: 1000 distinct points
    assert grid[0].item() == pytest.approx(first, abs=1e-7)
    assert grid[500].item() == pytest.approx(middle, abs=1e-6)
    assert grid[-1].item() == pytest.approx(last, abs=1e-7)


@pytest.mark.parametrize("template", fm.DIFFSYNTH_TEMPLATES)
def test_diffsynth_weights_are_zero_at_pure_noise_mean_one_and_follow_the_bump(template):
    grid, weights = fm.diffsynth_sigmas(template), fm.diffsynth_weights(template)
    assert weights[0].item() == 0.0  # sigma = 1 (t = 1000) is the bump's minimum, shifted to 0
    assert weights.double().mean().item() == pytest.approx(1.0, abs=1e-6)
    # between two points, w_a / w_b = (y_a - y_min) / (y_b - y_min), y = exp(-2 ((t - 500) / 1000)^2)
    y = lambda sigma: math.exp(-2 * ((1000 * sigma - 500) / 1000) ** 2)
    a, b = grid[300].item(), grid[900].item()
    expected = (y(a) - y(1.0)) / (y(b) - y(1.0))
    assert (weights[300] / weights[900]).item() == pytest.approx(expected, rel=1e-5)
    # the loss weight of a grid sigma is its point's weight; an off-grid sigma takes its nearest point's
    assert torch.equal(fm.loss_weight(grid[[0, 300, 999]], "diffsynth", template), weights[[0, 300, 999]])
    between = (grid[300] * 0.9 + grid[301] * 0.1).view(1)
    assert fm.loss_weight(between, "diffsynth", template).item() == weights[300].item()


def test_diffsynth_sampling_reaches_every_grid_point_in_full_precision():
    grid = fm.diffsynth_sigmas("Qwen-Image")
    draws = fm.sample_sigmas(20_000, "diffsynth", torch.Generator().manual_seed(0), template="Qwen-Image")
    assert draws.dtype == torch.float32 and torch.isin(draws, grid).all()
    assert draws.unique().numel() == 1000  # bf16 timesteps would reach 376 of them
    assert torch.equal(draws, fm.sample_sigmas(20_000, "diffsynth", torch.Generator().manual_seed(0),
                                               template="Qwen-Image"))
    with pytest.raises(ValueError, match="template"):
        fm.sample_sigmas(1, "diffsynth", torch.Generator())


def test_unknown_scheme_names_the_choices():
    with pytest.raises(ValueError, match="logit_normal"):
        fm.sample_sigmas(1, "bogus", torch.Generator())


def test_auto_resolves_to_the_family_default_and_diffsynth_needs_a_template():
    from diffsynth_core.errors import InputError
    from diffsynth_core.models import get_family
    from diffsynth_core.training.loop import Schedule
    from stages.config import TrainSection

    from .toy import TOY_SPEC

    qwen = Schedule.resolve(TrainSection(), get_family("qwen_image"))
    assert (qwen.sampling, qwen.weighting, qwen.template) == ("diffsynth", "diffsynth", "Qwen-Image")
    assert Schedule.resolve(TrainSection(timestep_sampling="shift"), get_family("flux")).sampling == "shift"
    assert Schedule.resolve(TrainSection(), TOY_SPEC).sampling == "uniform"  # FamilySpec's own default
    with pytest.raises(InputError, match="toy"):
        Schedule.resolve(TrainSection(loss_weighting="diffsynth"), TOY_SPEC)
