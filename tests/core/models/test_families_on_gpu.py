"""The tiny families on a CUDA device in bf16: load, encode, one LoRA step (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.models import get_family
from diffsynth_core.training.device import avoid_broken_kernels
from diffsynth_core.training.lora import resolve_lora_targets

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family, frames, variant", [("qwen_image", 1, None), ("flux", 1, None), ("wan", 5, None),
                                                     ("wan", 5, "ti2v-5b"), ("qwen_image21", 1, None),
                                                     ("flux2", 1, "dev"), ("flux2", 1, "klein-base-4b")])
def test_tiny_family_loads_encodes_and_trains_on_cuda(family, frames, variant, tmp_path):
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    avoid_broken_kernels("cuda")  # cuDNN attention gives NaN gradients here (see training/device.py)
    spec = get_family(family, variant)
    folder = spec.save_tiny_model(tmp_path / family, 0)
    names = spec.encoder_components + (spec.transformer_component,)
    comps = spec.load_components(folder, names, torch.bfloat16, "cuda")
    for name, component in comps.items():
        if isinstance(component, torch.nn.Module):
            assert all(p.device.type == "cuda" for p in component.parameters()), name
    cond = {k: v[None] for k, v in spec.encode_prompt(comps, "a photo of a cat", "cuda").items()}
    pixels = torch.rand(3, frames, 64, 64) * 2 - 1
    latents = spec.encode_pixels(comps, pixels, "cuda")["latents"][None]
    assert latents.device.type == "cuda" and all(v.device.type == "cuda" for v in cond.values())
    transformer = comps[spec.transformer_component]
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                       target_modules=resolve_lora_targets(transformer, spec.lora_target_modules)))
    cast_training_params(transformer, torch.float32)
    transformer.enable_gradient_checkpointing()
    noise = torch.randn_like(latents)
    sigmas = torch.tensor([0.5], device="cuda")
    pred = spec.dit_forward(transformer, 0.5 * latents + 0.5 * noise, sigmas, cond)
    torch.nn.functional.mse_loss(pred.float(), (noise - latents).float()).backward()
    grads = [p.grad for p in transformer.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
