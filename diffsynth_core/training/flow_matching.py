"""Flow-matching math as small pure functions.

Conventions (rectified flow, as FLUX / Qwen-Image / Wan train):
    x_t = (1 - sigma) * x0 + sigma * noise,     target velocity = noise - x0,
with sigma in [0, 1] (1 = pure noise).  Sigmas are sampled in float32 (the reference casts
timesteps to bf16 and so reaches only 376 of its 1000 steps); every random draw takes an
explicit generator so training is reproducible and resumable.
"""

from __future__ import annotations

import math

import torch

SAMPLING_SCHEMES = ("uniform", "logit_normal", "shift", "resolution_shift")
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "cosmap")


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/Wan time shift: s*t / (1 + (s-1)*t); shift > 1 moves mass towards noise."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def resolution_shift(num_tokens: int, base_tokens: int = 256, max_tokens: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX-style resolution-dependent shift exp(mu), mu linear in the image's token count."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    mu = base_shift + slope * (num_tokens - base_tokens)
    return math.exp(mu)


def sample_sigmas(n: int, scheme: str, generator: torch.Generator, *, logit_mean: float = 0.0,
                  logit_std: float = 1.0, shift: float = 3.0, num_tokens: int | None = None) -> torch.Tensor:
    """Draw ``n`` sigmas in (0, 1) as float32 on the generator's device."""
    if scheme == "uniform":
        return torch.rand(n, generator=generator, dtype=torch.float32)
    if scheme == "logit_normal":
        normal = torch.randn(n, generator=generator, dtype=torch.float32)
        return torch.sigmoid(logit_mean + logit_std * normal)
    if scheme == "shift":
        return shift_sigmas(torch.rand(n, generator=generator, dtype=torch.float32), shift)
    if scheme == "resolution_shift":
        if num_tokens is None:
            raise ValueError("timestep sampling 'resolution_shift' needs num_tokens")
        uniform = torch.rand(n, generator=generator, dtype=torch.float32)
        return shift_sigmas(uniform, resolution_shift(num_tokens))
    raise ValueError(f"unknown timestep sampling {scheme!r}; choose one of {', '.join(SAMPLING_SCHEMES)}")


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - sigma) x0 + sigma noise, sigma broadcast over all but the batch dim."""
    s = sigmas.to(torch.float32).view(-1, *([1] * (x0.ndim - 1)))
    return ((1.0 - s) * x0.float() + s * noise.float()).to(x0.dtype)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise.float() - x0.float()


def loss_weight(sigmas: torch.Tensor, scheme: str) -> torch.Tensor:
    """Per-sample loss weights (SD3 paper's schemes), float32."""
    sigmas = sigmas.to(torch.float32)
    if scheme == "none":
        return torch.ones_like(sigmas)
    if scheme == "sigma_sqrt":
        return sigmas.clamp_min(1e-4) ** -2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * sigmas + 2.0 * sigmas**2))
    raise ValueError(f"unknown loss weighting {scheme!r}; choose one of {', '.join(WEIGHTING_SCHEMES)}")


def flow_matching_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted MSE in float32: mean over elements per sample, then weighted mean over the batch."""
    per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)
    return (weights * per_sample).mean()
