"""Flow-matching math as small pure functions.

Conventions (rectified flow, as FLUX / Qwen-Image / Wan train):
    x_t = (1 - sigma) * x0 + sigma * noise,     target velocity = noise - x0,
with sigma in [0, 1] (1 = pure noise).  Sigmas are sampled in float32 (the reference casts
timesteps to bf16 and so reaches only 376 of its 1000 steps); every random draw takes an
explicit generator so training is reproducible and resumable.

``diffsynth`` sampling and weighting reproduce DiffSynth-Studio's training schedule: a fixed
1000-point sigma grid per model template (shift, sigma range, exponential shift), drawn
uniformly by index, and its bell-shaped loss weights (0 at sigma = 1, mean 1 over the grid).
docs/training.md tabulates every scheme.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

SAMPLING_SCHEMES = ("uniform", "logit_normal", "shift", "resolution_shift", "diffsynth")
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "cosmap", "diffsynth")
DIFFSYNTH_TEMPLATES = ("FLUX.1", "Wan", "Qwen-Image", "Z-Image", "FLUX.2")
DIFFSYNTH_STEPS = 1000  # DiffSynth trains on set_timesteps(1000, training=True)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/Wan time shift: s*t / (1 + (s-1)*t); shift > 1 moves mass towards noise."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def resolution_shift(num_tokens: int, base_tokens: int = 256, max_tokens: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX-style resolution-dependent shift exp(mu), mu linear in the image's token count."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    mu = base_shift + slope * (num_tokens - base_tokens)
    return math.exp(mu)


# --- DiffSynth-Studio's training schedule ------------------------------------------------------
# Source: DiffSynth-Studio diffsynth/diffusion/flow_match.py (FlowMatchScheduler.set_timesteps_flux,
# set_timesteps_wan, set_timesteps_qwen_image, set_timesteps_z_image, set_timesteps_flux2, set_training_weight,
# training_weight), called as set_timesteps(1000, training=True) by diffsynth/diffusion/training_module.py; the
# loss that draws from it is diffsynth/diffusion/loss.py::FlowMatchSFTLoss.  Computed in float64, kept in float32.

def _exponential_shift(sigmas: torch.Tensor, mu: float) -> torch.Tensor:
    """e^mu / (e^mu + 1/sigma - 1): DiffSynth's Qwen-Image and FLUX.2 shift."""
    return math.exp(mu) / (math.exp(mu) + (1.0 / sigmas - 1.0))


@lru_cache(maxsize=None)
def diffsynth_sigmas(template: str, steps: int = DIFFSYNTH_STEPS) -> torch.Tensor:
    """DiffSynth's training sigma grid for ``template``, from 1 (noise) down, ``steps`` points."""
    if template == "FLUX.1":  # both ends included, then shift 3
        grid = torch.linspace(1.0, 0.003 / 1.002, steps, dtype=torch.float64)
        return shift_sigmas(grid, 3.0).float()
    open_grid = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]  # 1 .. 1/steps
    if template == "Wan":
        return shift_sigmas(open_grid, 5.0).float()
    if template == "Z-Image":  # set_timesteps_z_image: Wan's grid with shift 3
        return shift_sigmas(open_grid, 3.0).float()
    if template == "FLUX.2":  # set_timesteps_flux2 without a length: exponential shift, mu = 0.8, no terminal
        return _exponential_shift(open_grid, 0.8).float()  # its linspace(1, 1/steps, steps) is the open grid
    if template == "Qwen-Image":  # exponential shift, mu = 0.8, then the last point stretched to 0.02
        mu, shift_terminal = 0.8, 0.02
        shifted = _exponential_shift(open_grid, mu)
        one_minus = 1.0 - shifted
        return (1.0 - one_minus / (one_minus[-1] / (1.0 - shift_terminal))).float()
    raise ValueError(f"unknown DiffSynth schedule template {template!r}; "
                     f"known: {', '.join(DIFFSYNTH_TEMPLATES)}")


@lru_cache(maxsize=None)
def diffsynth_weights(template: str, steps: int = DIFFSYNTH_STEPS) -> torch.Tensor:
    """DiffSynth's per-grid-point loss weights: a Gaussian bump in t = 1000 sigma, shifted to 0 at its
    minimum and scaled to mean 1 (its ``set_training_weight`` for a 1000-step grid)."""
    t = diffsynth_sigmas(template, steps).double() * 1000.0
    bump = torch.exp(-2.0 * ((t - 500.0) / 1000.0) ** 2)
    shifted = bump - bump.min()
    return (shifted * (steps / shifted.sum())).float()


def _nearest_grid_index(sigmas: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the closest grid point per sigma (DiffSynth's ``argmin |timesteps - t|``)."""
    return (sigmas.to(torch.float32).view(-1, 1) - grid.view(1, -1)).abs().argmin(dim=1)


# --- sampling and weighting ------------------------------------------------------------------

def sample_sigmas(n: int, scheme: str, generator: torch.Generator, *, logit_mean: float = 0.0,
                  logit_std: float = 1.0, shift: float = 3.0, num_tokens: int | None = None,
                  template: str | None = None, sigma_range: tuple[float, float] | None = None) -> torch.Tensor:
    """Draw ``n`` sigmas in (0, 1] as float32 on the generator's device.

    ``sigma_range = (low, high)``: the scheme's distribution cut to ``[low, high]`` (one expert of
    several, DiffSynth's timestep boundaries), drawn by inverting its CDF from a uniform draw on the
    cut's quantiles (one draw per sigma, as uncut); ``diffsynth`` draws among the grid points inside.
    """
    if sigma_range is not None and tuple(sigma_range) != (0.0, 1.0):
        return _sample_in_range(n, scheme, generator, tuple(sigma_range), logit_mean=logit_mean,
                                logit_std=logit_std, shift=_scheme_shift(scheme, shift, num_tokens), template=template)
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
    if scheme == "diffsynth":
        grid = diffsynth_sigmas(_need_template(template, "timestep sampling"))
        return grid[torch.randint(len(grid), (n,), generator=generator)]
    raise ValueError(f"unknown timestep sampling {scheme!r}; choose one of {', '.join(SAMPLING_SCHEMES)}")


def _scheme_shift(scheme: str, shift: float, num_tokens: int | None) -> float:
    if scheme == "resolution_shift":
        if num_tokens is None:
            raise ValueError("timestep sampling 'resolution_shift' needs num_tokens")
        return resolution_shift(num_tokens)
    return shift


def unshift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of :func:`shift_sigmas`."""
    return sigmas / (shift - (shift - 1.0) * sigmas)


def _sample_in_range(n: int, scheme: str, generator: torch.Generator, sigma_range: tuple[float, float], *,
                     logit_mean: float, logit_std: float, shift: float, template: str | None) -> torch.Tensor:
    low, high = (float(v) for v in sigma_range)
    if scheme == "diffsynth":
        grid = diffsynth_sigmas(_need_template(template, "timestep sampling"))
        inside = ((grid >= low) & (grid <= high)).nonzero().flatten()
        if len(inside) == 0:
            raise ValueError(f"no point of DiffSynth's {template} schedule lies in sigma range [{low}, {high}]")
        return grid[inside[torch.randint(len(inside), (n,), generator=generator)]]
    bounds = torch.tensor([low, high], dtype=torch.float64)
    if scheme == "uniform":
        quantiles = bounds
    elif scheme in ("shift", "resolution_shift"):
        quantiles = unshift_sigmas(bounds, shift)
    elif scheme == "logit_normal":
        logits = torch.logit(bounds.clamp(1e-12, 1 - 1e-12))
        quantiles = torch.special.ndtr((logits - logit_mean) / logit_std)
    else:
        raise ValueError(f"unknown timestep sampling {scheme!r}; choose one of {', '.join(SAMPLING_SCHEMES)}")
    u = quantiles[0] + (quantiles[1] - quantiles[0]) * torch.rand(n, generator=generator, dtype=torch.float64)
    if scheme == "uniform":
        sigmas = u
    elif scheme == "logit_normal":
        sigmas = torch.sigmoid(logit_mean + logit_std * torch.special.ndtri(u))
    else:
        sigmas = shift * u / (1.0 + (shift - 1.0) * u)
    return sigmas.clamp(low, high).float()


def loss_weight(sigmas: torch.Tensor, scheme: str, template: str | None = None) -> torch.Tensor:
    """Per-sample loss weights, float32: the SD3 paper's schemes, or DiffSynth's grid weights
    (the weight of the nearest grid point, as DiffSynth looks it up)."""
    sigmas = sigmas.to(torch.float32)
    if scheme == "none":
        return torch.ones_like(sigmas)
    if scheme == "sigma_sqrt":
        return sigmas.clamp_min(1e-4) ** -2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1.0 - 2.0 * sigmas + 2.0 * sigmas**2))
    if scheme == "diffsynth":
        template = _need_template(template, "loss weighting")
        index = _nearest_grid_index(sigmas.cpu(), diffsynth_sigmas(template))
        return diffsynth_weights(template)[index].to(sigmas.device)
    raise ValueError(f"unknown loss weighting {scheme!r}; choose one of {', '.join(WEIGHTING_SCHEMES)}")


def _need_template(template: str | None, what: str) -> str:
    if template is None:
        raise ValueError(f"{what} 'diffsynth' needs the family's DiffSynth schedule template, and it has none")
    return template


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - sigma) x0 + sigma noise, sigma broadcast over all but the batch dim."""
    s = sigmas.to(torch.float32).view(-1, *([1] * (x0.ndim - 1)))
    return ((1.0 - s) * x0.float() + s * noise.float()).to(x0.dtype)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise.float() - x0.float()


def flow_matching_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted MSE in float32: mean over elements per sample, then weighted mean over the batch."""
    per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)
    return (weights * per_sample).mean()
