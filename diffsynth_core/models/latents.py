"""VAE encoding shared by the families whose VAEs normalise latents per channel (Qwen-Image, Wan)."""

from __future__ import annotations

import torch


def per_channel_normalised_modes(vae, pixels: torch.Tensor, device: str) -> torch.Tensor:
    """The posterior modes of ``pixels (B, 3, F, H, W)``, as ``(z - latents_mean) / latents_std``.

    Returns ``(B, C, f, h, w)`` in the VAE's dtype: what the pipelines feed their DiTs, and
    deterministic (the mode, not a sample), so the cache is reproducible.
    """
    with torch.no_grad():
        z = vae.encode(pixels.to(device=device, dtype=vae.dtype)).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    return ((z.float() - mean) / std).to(vae.dtype)

