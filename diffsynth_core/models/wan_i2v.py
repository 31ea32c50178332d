"""Wan image-to-video conditioning: what stage 1 caches from a clip's first frame, and how the DiT reads it.

Two conventions, as diffusers' ``WanImageToVideoPipeline`` (pipeline_wan_i2v.py, ``prepare_latents``,
``encode_image`` and the denoising loop) conditions:

* **concatenated** (Wan2.1 I2V 14B, Wan2.2 I2V-A14B): the first frame followed by zero frames to the
  clip's length goes through the VAE -> ``ref_latents_0 (16, f, h, w)``; a mask of the frames given ->
  ``ref_mask_0 (4, f, h, w)`` (the first pixel frame counted 4 times, as the VAE folds 4 frames into
  one); the DiT takes ``[latents, mask, condition]`` (36 channels).  Wan2.1 I2V adds the CLIP vision
  tower's penultimate hidden states of the image -> ``image_embeds (257, 1280)``.
* **first latent frame** (Wan2.2 TI2V-5B, ``expand_timesteps``): the image alone through the VAE ->
  ``ref_latents_0 (48, 1, h, w)``, which replaces the first latent frame of the noisy input, whose
  tokens get timestep 0.  That frame is given, not predicted: ``dit_forward`` returns there the
  velocity that takes the noisy frame to the given one, a constant without gradient, so only the
  generated frames train.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .latents import per_channel_normalised_modes

# The CLIP tower identifies and conditions (an encoder component); a diffusers folder's image processor is
# loaded beside it, and Wan's released .pth brings none (``image_processor`` below).
IMAGE_COMPONENTS = ("image_encoder",)
FOLDER_IMAGE_COMPONENTS = ("image_encoder", "image_processor")
# OpenAI CLIP's pixel statistics, which Wan's clip.py normalises with
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def first_frame_mask(frames: int, height: int, width: int, temporal: int = 4) -> torch.Tensor:
    """``(temporal, f, h, w)`` for a clip of ``frames`` pixel frames: 1 where a frame is given (the first)."""
    mask = torch.zeros(1, frames, height, width)
    mask[:, 0] = 1
    mask = torch.cat([mask[:, :1].repeat_interleave(temporal, dim=1), mask[:, 1:]], dim=1)
    return mask.view(-1, temporal, height, width).transpose(0, 1).contiguous()


def _to_pil(image: torch.Tensor):
    """``(3, 1, H, W)`` in [-1, 1] -> the RGB image it was read from (what the CLIP processor takes)."""
    from PIL import Image

    array = ((image[:3, 0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(array)


def image_processor(components):
    """The folder's processor (diffusers' pipeline: shortest side to the tower's size, centre crop); for Wan's
    released CLIP, which brings none, Wan's own preprocessing: the image squeezed to the tower's square
    (bicubic) and normalised with CLIP's statistics (Wan's clip.py ``visual``; DiffSynth-Studio
    wan_video_image_encoder.py ``encode_image``)."""
    if components.get("image_processor") is not None:
        return components["image_processor"]
    from transformers import CLIPImageProcessorPil  # PIL's bicubic, whichever backends are installed

    size = components["image_encoder"].config.image_size
    return CLIPImageProcessorPil(size={"height": size, "width": size}, do_center_crop=False, image_mean=CLIP_MEAN,
                                 image_std=CLIP_STD)


def image_embeds(components, image: torch.Tensor, device: str) -> torch.Tensor:
    """CLIP's penultimate hidden states of the image, ``(257, 1280)`` for the release (``encode_image``)."""
    encoder = components["image_encoder"]
    inputs = image_processor(components)(images=_to_pil(image), return_tensors="pt").to(device)
    with torch.no_grad():
        hidden = encoder(pixel_values=inputs["pixel_values"].to(encoder.dtype), output_hidden_states=True)
    return hidden.hidden_states[-2][0]


def encode_concatenated(components, pixels: Sequence[torch.Tensor], device: str, *,
                        target_shape: Sequence[int]) -> dict[str, torch.Tensor]:
    """Wan2.1 / Wan2.2-A14B I2V: the first frame padded with zero frames to the target's ``F`` through the
    VAE, the mask of given frames, and (when the model has a CLIP tower) the image embedding."""
    (image,) = pixels
    frames = int(target_shape[1])
    clip = torch.cat([image[:3], image.new_zeros(3, frames - 1, *image.shape[2:])], dim=1)
    latents = per_channel_normalised_modes(components["vae"], clip[None], device)[0]
    out = {"ref_latents_0": latents,
           "ref_mask_0": first_frame_mask(frames, *latents.shape[2:]).to(latents.dtype)}
    if components.get("image_encoder") is not None:
        out["image_embeds"] = image_embeds(components, image, device)
    return out


def encode_first_frame(components, pixels: Sequence[torch.Tensor], device: str, *,
                       target_shape: Sequence[int]) -> dict[str, torch.Tensor]:
    """TI2V-5B: the image alone through the VAE, ``(48, 1, h, w)``."""
    (image,) = pixels
    return {"ref_latents_0": per_channel_normalised_modes(components["vae"], image[None, :3], device)[0]}


def concatenated_inputs(latents: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[latents, mask, condition]`` on the channel axis (36 channels for the release)."""
    return torch.cat([latents, cond["ref_mask_0"].to(latents.dtype), cond["ref_latents_0"].to(latents.dtype)], dim=1)


def with_first_frame(latents: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents with the given first frame in place, the per-frame mask (B, 1, f, 1, 1): 0 where given)."""
    mask = torch.ones(latents.shape[0], 1, latents.shape[2], 1, 1, dtype=latents.dtype, device=latents.device)
    mask[:, :, 0] = 0
    given = cond["ref_latents_0"].to(latents.dtype)
    return (1 - mask) * given + mask * latents, mask


def given_frame_velocity(noisy: torch.Tensor, sigmas: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """The velocity that takes the noisy first frame to the given one, ``(x_t - x_0) / sigma``: its loss
    term is a constant without gradient."""
    s = sigmas.float().clamp_min(1e-6).view(-1, 1, 1, 1, 1)
    return ((noisy[:, :, :1].float() - given.float()) / s).detach()
