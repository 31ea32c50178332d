"""Per-family test data for the conformance suite: tiny-model variant, input sizes, and how to
turn the arguments a diffusers pipeline passes to its transformer back into
``dit_forward``'s ``(latents, sigmas, cond)`` (so the suite can check our conventions
against the pipeline's own denoiser call)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class FamilyCase:
    id: str
    family: str
    pixels_shape: tuple[int, int, int, int]  # (3, F, H, W)
    pipeline_kwargs: dict[str, Any]  # pipe(...) kwargs for one denoising step, latent output
    # (pipe, transformer kwargs, transformer output) -> (latents, sigmas, cond, output in the latents' layout)
    from_pipeline_call: Callable[[Any, dict[str, Any], torch.Tensor], tuple]
    # (pipe, prompt) -> the pipeline's own encode_prompt result under our key names, no batch dim
    pipeline_prompt: Callable[[Any, str], dict[str, torch.Tensor]]
    tiny_kwargs: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None  # the family's variant (FamilySpec.variants) this case checks

    def save_tiny(self, spec, out_dir, seed=0):
        return functools.partial(spec.save_tiny_model, **self.tiny_kwargs)(out_dir, seed)


def _qwen_inputs(pipe, kw, out):
    h, w = kw["img_shapes"][0][0][1:]
    unpack = functools.partial(pipe._unpack_latents, height=h * 16, width=w * 16, vae_scale_factor=8)
    latents = unpack(kw["hidden_states"])
    embeds = kw["encoder_hidden_states"]
    mask = kw["encoder_hidden_states_mask"]
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
    return latents, kw["timestep"], {"prompt_embeds": embeds, "prompt_embeds_mask": mask}, unpack(out)


def _qwen_prompt(pipe, prompt):
    embeds, mask = pipe.encode_prompt(prompt)
    mask = torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask
    return {"prompt_embeds": embeds[0], "prompt_embeds_mask": mask[0]}


def _flux_inputs(pipe, kw, out):
    ids = kw["img_ids"]
    h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    unpack = functools.partial(pipe._unpack_latents, height=h * 16, width=w * 16, vae_scale_factor=8)
    cond = {"prompt_embeds": kw["encoder_hidden_states"], "pooled_prompt_embeds": kw["pooled_projections"]}
    if pipe.transformer.config.guidance_embeds:
        assert torch.equal(kw["guidance"], torch.full_like(kw["guidance"], 3.5))
    else:
        assert kw["guidance"] is None
    return unpack(kw["hidden_states"])[:, :, None], kw["timestep"], cond, unpack(out)[:, :, None]


def _flux_prompt(pipe, prompt):
    embeds, pooled, _ = pipe.encode_prompt(prompt, prompt_2=None, max_sequence_length=pipe.tokenizer_2.model_max_length)
    return {"prompt_embeds": embeds[0], "pooled_prompt_embeds": pooled[0]}


def _wan_inputs(pipe, kw, out):
    sigmas = kw["timestep"].float() / 1000  # the pipeline passes t = 1000 sigma
    return kw["hidden_states"], sigmas, {"prompt_embeds": kw["encoder_hidden_states"]}, out


def _wan_per_token_inputs(pipe, kw, out):
    """TI2V-5B (expand_timesteps): one timestep per latent token, all equal without a first frame."""
    t = kw["timestep"].float()
    assert t.ndim == 2 and torch.equal(t, t[:, :1].expand_as(t))
    return kw["hidden_states"], t[:, 0] / 1000, {"prompt_embeds": kw["encoder_hidden_states"]}, out


def _wan_prompt(pipe, prompt):
    embeds, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False,
                                   max_sequence_length=pipe.tokenizer.model_max_length)
    return {"prompt_embeds": embeds[0]}


CASES = [
    FamilyCase("qwen_image", "qwen_image", (3, 1, 64, 96),
               dict(height=64, width=96, num_inference_steps=2), _qwen_inputs, _qwen_prompt),
    FamilyCase("flux_dev", "flux", (3, 1, 64, 96), dict(height=64, width=96, num_inference_steps=2,
               max_sequence_length=32), _flux_inputs, _flux_prompt),
    FamilyCase("flux_schnell", "flux", (3, 1, 64, 64), dict(height=64, width=64, num_inference_steps=2,
               guidance_scale=0.0, max_sequence_length=32), _flux_inputs, _flux_prompt,
               tiny_kwargs={"guidance_embeds": False}),
    FamilyCase("wan", "wan", (3, 5, 64, 64), dict(height=64, width=64, num_frames=5, num_inference_steps=2,
               guidance_scale=1.0, max_sequence_length=32), _wan_inputs, _wan_prompt),
    FamilyCase("wan_ti2v_5b", "wan", (3, 5, 64, 64), dict(height=64, width=64, num_frames=5, num_inference_steps=2,
               guidance_scale=1.0, max_sequence_length=32), _wan_per_token_inputs, _wan_prompt,
               variant="ti2v-5b"),
]
