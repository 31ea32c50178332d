"""Per-family test data for the conformance suite: tiny-model variant, input sizes, and how to
turn the arguments a diffusers pipeline passes to its transformer back into
``dit_forward``'s ``(latents, sigmas, cond)`` (so the suite can check our conventions
against the pipeline's own denoiser call)."""

from __future__ import annotations

import contextlib
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
    # context the pipeline call runs in (the edit cases shrink the pipelines' reference sizes)
    pipeline_context: Callable[[], Any] = contextlib.nullcontext
    tiny_kwargs: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None  # FamilySpec.variants entry the case tests
    # encode_prompt's extra keyword arguments (an edit's reference images); pipeline_prompt gets the same
    prompt_kwargs: dict[str, Any] = field(default_factory=dict)
    # (3, 1, H, W) pixel shapes of reference images, VAE-encoded into ``ref_latents_<i>`` for training
    reference_shapes: tuple[tuple[int, int, int, int], ...] = ()

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


def _qwen_edit_inputs(pipe, kw, out):
    """The edit pipelines pack the references after the target: split them back by ``img_shapes``."""
    shapes = kw["img_shapes"][0]
    sizes = [h * w for _, h, w in shapes]
    pieces = torch.split(kw["hidden_states"], sizes, dim=1)
    unpacked = [pipe._unpack_latents(p, h * 16, w * 16, 8) for p, (_, h, w) in zip(pieces, shapes)]
    target_only = {**kw, "hidden_states": pieces[0], "img_shapes": [shapes[:1]]}
    latents, sigmas, cond, target = _qwen_inputs(pipe, target_only, out[:, : sizes[0]])
    cond.update({f"ref_latents_{i}": ref for i, ref in enumerate(unpacked[1:])})
    return latents, sigmas, cond, target


def _qwen_edit_prompt(pipe, prompt, images):
    embeds, mask = pipe.encode_prompt(prompt, image=images)
    mask = torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask
    return {"prompt_embeds": embeds[0], "prompt_embeds_mask": mask[0]}


@functools.cache
def edit_images(scale: int = 1):
    """Two small reference images of different aspect (a red square on grey, a blue bar on white); ``scale``
    multiplies every side (the FLUX.2 pipelines refuse references under 64 pixels a side)."""
    from PIL import Image, ImageDraw

    first = Image.new("RGB", (64 * scale, 48 * scale), "grey")
    ImageDraw.Draw(first).rectangle(tuple(c * scale for c in (16, 12, 40, 36)), fill="red")
    second = Image.new("RGB", (48 * scale, 64 * scale), "white")
    ImageDraw.Draw(second).rectangle(tuple(c * scale for c in (8, 20, 40, 30)), fill="blue")
    return first, second


@contextlib.contextmanager
def small_references(area=64 * 64):
    """The edit pipelines resize references to about 1024² (VAE) and 384² (vision tower): a small
    ``area`` keeps a tiny model's pipeline call cheap on the CPU and computes the same way."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as v1, pipeline_qwenimage_edit_plus as plus

    saved = (v1.calculate_dimensions, plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE)
    original = v1.calculate_dimensions
    v1.calculate_dimensions = lambda target_area, ratio: original(area, ratio)
    plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE = area, area // 2
    try:
        yield
    finally:
        v1.calculate_dimensions, plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE = saved


def _edit_case(variant, count):
    images = list(edit_images()[:count])
    one = variant == "edit"
    return FamilyCase(f"qwen_image_{variant}", "qwen_image", (3, 1, 64, 96),
                      dict(height=64, width=96, num_inference_steps=2, image=images[0] if one else images),
                      _qwen_edit_inputs,
                      lambda pipe, prompt: _qwen_edit_prompt(pipe, prompt, images[0] if one else images),
                      pipeline_context=small_references, variant=variant, prompt_kwargs={"images": images},
                      reference_shapes=tuple((3, 1, 32 + 32 * i, 64) for i in range(count)))


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
    _edit_case("edit", 1),
    _edit_case("edit-2509", 2),
    _edit_case("edit-2511", 2),
    FamilyCase("wan_ti2v_5b", "wan", (3, 5, 64, 64), dict(height=64, width=64, num_frames=5, num_inference_steps=2,
               guidance_scale=1.0, max_sequence_length=32), _wan_per_token_inputs, _wan_prompt,
               variant="ti2v-5b"),
]


def _z_image_inputs(pipe, kw, out):
    """ZImagePipeline calls its DiT with lists: latents (C, 1, h, w) and prompts (L_i, D) of their own
    lengths, timestep (1000 - t) / 1000 = 1 - sigma, and negates the output (x0 - noise) into the velocity."""
    prompts = kw["cap_feats"]
    longest = max(p.shape[0] for p in prompts)
    embeds = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in prompts])
    mask = torch.stack([(torch.arange(longest) < p.shape[0]).long() for p in prompts])
    sigmas = 1 - kw["t"]
    return torch.stack(kw["x"]), sigmas, {"prompt_embeds": embeds, "prompt_embeds_mask": mask}, -torch.stack(out)


def _z_image_prompt(pipe, prompt):
    embeds, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False)
    return {"prompt_embeds": embeds[0], "prompt_embeds_mask": torch.ones(embeds[0].shape[0], dtype=torch.long)}


# guidance_scale 4: the pipeline batches the prompt with the empty negative prompt, two lengths, so the
# padded batch and its mask are checked against the DiT's own list of prompts.
CASES.append(FamilyCase("z_image", "z_image", (3, 1, 64, 96), dict(height=64, width=96, num_inference_steps=2,
                        guidance_scale=4.0), _z_image_inputs, _z_image_prompt))


def _qwen21_inputs(pipe, kw, out):
    """QwenImage21Pipeline packs the references first and the target last (``img_shapes`` in that order),
    its ``img_mask`` is the prompt's image-pad mask plus the target's slots, and its output spans the whole
    joint sequence: the target's tokens are the last."""
    shapes = kw["img_shapes"][0]
    pieces = torch.split(kw["hidden_states"], [h * w for _, h, w in shapes], dim=1)
    *refs, target = [pipe._unpack_latents(p, h * 16, w * 16, 16) for p, (_, h, w) in zip(pieces, shapes)]
    embeds, mask = kw["encoder_hidden_states"], kw["encoder_hidden_states_mask"]
    mask = torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask
    cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "image_pad_mask": kw["img_mask"][:, :embeds.shape[1]]}
    cond.update({f"ref_latents_{i}": ref for i, ref in enumerate(refs)})
    _, h, w = shapes[-1]
    return target, kw["timestep"], cond, pipe._unpack_latents(out[:, -h * w:], h * 16, w * 16, 16)


def _qwen21_prompt(pipe, prompt, images=None):
    embeds, mask, pad = pipe.encode_prompt(prompt, image=images)
    mask = torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask
    return {"prompt_embeds": embeds[0], "prompt_embeds_mask": mask[0], "image_pad_mask": pad[0]}


@functools.cache
def qwen21_images():
    """Two references at multiples of 32 (the vision tower's and the VAE's sizes are one): a half-transparent
    red bar (RGBA, composited over white for the vision tower) and a blue square on white."""
    from PIL import Image, ImageDraw

    first = Image.new("RGBA", (64, 32), (0, 0, 0, 0))
    ImageDraw.Draw(first).rectangle((8, 8, 56, 24), fill=(255, 0, 0, 160))
    second = Image.new("RGB", (32, 64), "white")
    ImageDraw.Draw(second).rectangle((4, 20, 28, 44), fill="blue")
    return first, second


CASES.append(FamilyCase("qwen_image21", "qwen_image21", (4, 1, 64, 96), dict(height=64, width=96,
                        num_inference_steps=2), _qwen21_inputs, _qwen21_prompt))
# output_resolution 64: the pipeline resizes references to about 64² (1024² by default), cheap on the CPU
CASES.append(FamilyCase("qwen_image21_edit", "qwen_image21", (4, 1, 64, 96),
                        dict(height=64, width=96, num_inference_steps=2, image=list(qwen21_images()),
                             output_resolution=64), _qwen21_inputs,
                        lambda pipe, prompt: _qwen21_prompt(pipe, prompt, list(qwen21_images())),
                        prompt_kwargs={"images": list(qwen21_images())},
                        reference_shapes=((4, 1, 32, 64), (3, 1, 64, 32))))
def _flux2_inputs(pipe, kw, out):
    """The FLUX.2 pipelines pack the target's tokens, then each reference's (ids with time 10, 20, ...): split
    them back by their ids' time coordinate; the text ids are (0, 0, 0, l); dev's guidance is the call's."""
    ids = kw["img_ids"][0] if kw["img_ids"].ndim == 3 else kw["img_ids"]
    tokens, (b, _, c) = kw["hidden_states"], kw["hidden_states"].shape
    assert torch.equal(kw["txt_ids"][0, :, 3], torch.arange(kw["encoder_hidden_states"].shape[1]))
    assert kw["guidance"] is None if not pipe.transformer.config.guidance_embeds else \
        torch.equal(kw["guidance"], torch.ones_like(kw["guidance"]))
    grids, start = [], 0
    for t in dict.fromkeys(ids[:, 0].tolist()):
        part = ids[ids[:, 0] == t]
        h, w = int(part[:, 1].max()) + 1, int(part[:, 2].max()) + 1
        grids.append(tokens[:, start:start + h * w].permute(0, 2, 1).reshape(b, c, h, w)[:, :, None])
        start += h * w
    n = grids[0].shape[-2] * grids[0].shape[-1]
    target = out[:, :n].permute(0, 2, 1).reshape(grids[0].shape)
    cond = {"prompt_embeds": kw["encoder_hidden_states"], **{f"ref_latents_{i}": g for i, g in enumerate(grids[1:])}}
    return grids[0], kw["timestep"], cond, target


FLUX2_TOKENS = 64  # the pipelines pad every prompt to 512 tokens; 64 keeps the tiny 30-layer encoders quick


def _flux2_prompt(pipe, prompt):
    embeds, _ = pipe.encode_prompt(prompt, max_sequence_length=FLUX2_TOKENS)
    return {"prompt_embeds": embeds[0]}


# dev with two references (guidance 1: what dit_forward trains with); klein base text-to-image with CFG.
CASES += [
    FamilyCase("flux2_dev_edit", "flux2", (3, 1, 64, 96), dict(height=64, width=96, num_inference_steps=2,
               guidance_scale=1.0, image=list(edit_images(2)), max_sequence_length=FLUX2_TOKENS), _flux2_inputs,
               _flux2_prompt, variant="dev", prompt_kwargs={"max_sequence_length": FLUX2_TOKENS},
               reference_shapes=((3, 1, 32, 64), (3, 1, 48, 32))),
    FamilyCase("flux2_klein_base", "flux2", (3, 1, 64, 96), dict(height=64, width=96, num_inference_steps=2,
               guidance_scale=4.0, max_sequence_length=FLUX2_TOKENS), _flux2_inputs, _flux2_prompt,
               variant="klein-base-4b", prompt_kwargs={"max_sequence_length": FLUX2_TOKENS}),
]
