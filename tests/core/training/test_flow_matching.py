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


@pytest.mark.parametrize("scheme", fm.SAMPLING_SCHEMES)
def test_sampling_is_seeded_full_precision_and_in_range(scheme):
    draw = lambda: fm.sample_sigmas(4096, scheme, torch.Generator().manual_seed(3), num_tokens=1024)
    first, second = draw(), draw()
    assert torch.equal(first, second) and first.dtype == torch.float32
    assert 0.0 <= first.min() and first.max() <= 1.0
    # full precision: far more distinct values than the reference's 376 reachable timesteps
    assert first.unique().numel() > 4000


def test_unknown_scheme_names_the_choices():
    with pytest.raises(ValueError, match="logit_normal"):
        fm.sample_sigmas(1, "bogus", torch.Generator())
