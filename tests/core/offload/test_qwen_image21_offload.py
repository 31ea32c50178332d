"""Qwen-Image-2.1's DiT under the offload engine: LoRA training with the engine equals training without it,
bitwise on CPU in fp32, on an edit batch whose prompts differ in length (dit_forward then calls the DiT once
per slot layout, so the engine streams the blocks twice a step)."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.models import get_family
from diffsynth_core.offload import OffloadTrainingManager
from offload_tiny import add_lora, train

SPEC = get_family("qwen_image21")


def _inputs(model):
    latents, cond = SPEC.dummy_inputs(model.config, batch=3, height=32, width=64, text_len=6, references=2)
    cond["prompt_embeds_mask"][2, -3:] = 0  # the third prompt is three text tokens shorter, zero-padded
    cond["prompt_embeds"][2, -3:] = 0
    return latents, torch.tensor([0.3, 0.8, 0.5]), cond


@pytest.mark.parametrize("checkpoint", [False, True])
def test_qwen_image21_lora_training_with_the_engine_is_bitwise_identical(checkpoint):
    runs = []
    for engine in (False, True):
        model = SPEC.build_transformer("tiny", torch.float32, "cpu")
        torch.manual_seed(0)
        model = add_lora(model, SPEC.lora_target_modules)
        if checkpoint:
            apply_gradient_checkpointing(model, SPEC.block_container_names)
        mgr = (OffloadTrainingManager(model, "cpu", block_container_names=SPEC.block_container_names,
                                      poison_evicted=True) if engine else None)
        latents, sigmas, cond = _inputs(model)
        runs.append(train(model, 3, lambda s, m: SPEC.dit_forward(model, latents + s, sigmas, cond).pow(2).mean(), mgr))
        if mgr is not None:
            assert mgr.report()["streamed_units"] == len(model.transformer_blocks) == 2
            mgr.detach()
    (la, ga), (lb, gb) = runs
    assert len(la) == 3 and all(torch.equal(x, y) for x, y in zip(la, lb))
    assert all(len(a) > 0 and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(ga, gb))
