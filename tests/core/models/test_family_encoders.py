"""Stage 1's view of every family: lean encoder loading, batched encoding, VAE tiling.

``load_encoders`` must give exactly what the full components give while holding only what
encoding reads; batched encoding must give one-at-a-time results (up to the kernels' batch
dependence, bounded here for fp32 on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.models import get_family
from diffsynth_core.models.encoders import enable_vae_tiling
from diffsynth_core.models.qwen_image import _text_weight_name

from .family_cases import CASES

PROMPTS = ["a cat", "a photo of a red dog asleep on a blue sofa", "x"]
# flux_schnell: the same encoders as dev; qwen_image21_edit: 2.1's; flux2_dev_edit: run here under the family's
# base spec, the klein case's (dev's lean Mistral loader is checked against the pipeline in test_flux2.py)
CASES = [c for c in CASES if c.id not in ("flux_schnell", "qwen_image21_edit", "flux2_dev_edit")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def loaded(request, tmp_path_factory):
    case = request.param
    spec = get_family(case.family, case.variant)
    folder = case.save_tiny(spec, tmp_path_factory.mktemp(case.id) / "model", seed=0)
    full = spec.load_components(folder, spec.encoder_components, torch.float32, "cpu")
    return case, spec, full, spec.load_encoders(folder, torch.float32)


def _length(case) -> dict:
    """The case's prompt length, where it sets one (FLUX.2 pads every prompt to it: 512 is slow on a CPU)."""
    return {k: v for k, v in case.prompt_kwargs.items() if k == "max_sequence_length"}


def _pixels(case, n, seed=1, frames=None):
    shape = (n, *case.pixels_shape) if frames is None else (n, 3, frames, *case.pixels_shape[2:])
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_lean_encoders_encode_exactly_like_the_full_components(loaded):
    case, spec, full, lean = loaded
    for prompt in PROMPTS:
        want, got = (spec.encode_prompt(c, prompt, "cpu", **_length(case)) for c in (full, lean))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    pixels = _pixels(case, 1)[0]
    assert torch.equal(spec.encode_pixels(full, pixels, "cpu")["latents"],
                       spec.encode_pixels(lean, pixels, "cpu")["latents"])


def test_lean_encoders_hold_no_decoder_vision_tower_or_lm_head(loaded):
    """The vision tower stays where the prompt sees the references (the edit variants, Qwen-Image-2.1)."""
    _, spec, full, lean = loaded
    sees_images = spec.references is not None and spec.references.text_area is not None
    unused = ("decoder.", "post_quant_conv.", "lm_head.") + (() if sees_images else ("visual.",))
    names = {name for c in lean.values() if isinstance(c, torch.nn.Module) for name, _ in c.named_parameters()}
    assert not [n for n in names if n.startswith(unused)]
    lean_bytes = sum(p.numel() for c in lean.values() if isinstance(c, torch.nn.Module) for p in c.parameters())
    full_bytes = sum(p.numel() for c in full.values() if isinstance(c, torch.nn.Module) for p in c.parameters())
    # a tiny vision tower outweighs the tiny LM head and VAE decoder left out: only fewer where it stays
    assert lean_bytes < (1.0 if sees_images else 0.75) * full_bytes


def test_batched_encoding_matches_one_at_a_time(loaded):
    case, spec, _, lean = loaded
    batched = spec.encode_prompts(lean, PROMPTS, "cpu", **_length(case))
    for prompt, got in zip(PROMPTS, batched):
        want = spec.encode_prompt(lean, prompt, "cpu", **_length(case))
        for name in want:  # Qwen pads the batch to its longest prompt: ~1e-7 apart in fp32
            assert got[name].shape == want[name].shape, name
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    pixels = _pixels(case, 2, frames=1)  # Wan's video path is covered above; one frame keeps this fast
    for one, got in zip(pixels, spec.encode_pixel_batch(lean, pixels, "cpu")):
        torch.testing.assert_close(got["latents"], spec.encode_pixels(lean, one, "cpu")["latents"],
                                   rtol=1e-5, atol=1e-5)


def test_vae_tiling_cuts_tiles_and_keeps_the_latent_shape(loaded):
    case, spec, _, lean = loaded
    if case.family == "wan":
        pytest.skip("the Wan-style tiling API is Qwen-Image's (same diffusers VAE code)")
    pixels = torch.rand(1, 3, 1, 96, 96, generator=torch.Generator().manual_seed(2)) * 2 - 1
    whole = spec.encode_pixel_batch(lean, pixels, "cpu")[0]["latents"]
    enable_vae_tiling(lean["vae"], 64)
    try:
        tiled = spec.encode_pixel_batch(lean, pixels, "cpu")[0]["latents"]
    finally:
        lean["vae"].disable_tiling()
    assert tiled.shape == whole.shape and not torch.equal(tiled, whole)
    assert torch.equal(spec.encode_pixel_batch(lean, pixels, "cpu")[0]["latents"], whole)


def test_qwen_text_weights_are_found_under_both_checkpoint_layouts():
    assert _text_weight_name("model.layers.3.mlp.up_proj.weight") == "layers.3.mlp.up_proj.weight"
    assert _text_weight_name("model.language_model.norm.weight") == "norm.weight"
    assert _text_weight_name("model.embed_tokens.weight") == "embed_tokens.weight"
    for unused in ("lm_head.weight", "visual.blocks.0.attn.qkv.weight", "model.visual.merger.mlp.0.bias"):
        assert _text_weight_name(unused) is None
