"""Qwen-Image-2.1's DiT under the offload engine: LoRA training with the engine equals training without it,
bitwise on CPU in fp32, on an edit batch whose prompts differ in length (dit_forward then calls the DiT once
per slot layout, so the engine streams the blocks twice a step)."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.models import get_family
from offload_tiny import assert_equal_runs, family_runs_with_and_without_engine

SPEC = get_family("qwen_image21")


def _inputs(model):
    latents, cond = SPEC.dummy_inputs(model.config, batch=2, height=32, width=64, text_len=6, references=2)
    cond["prompt_embeds_mask"][1, -3:] = 0  # the second prompt is three text tokens shorter, zero-padded
    cond["prompt_embeds"][1, -3:] = 0
    return latents, torch.tensor([0.3, 0.8]), cond


@pytest.mark.parametrize("checkpoint", [False, True])
def test_qwen_image21_lora_training_with_the_engine_is_bitwise_identical(checkpoint):
    runs, streamed = family_runs_with_and_without_engine(SPEC, _inputs, checkpoint)
    assert streamed == 2  # the tiny DiT's two blocks
    assert_equal_runs(runs)
