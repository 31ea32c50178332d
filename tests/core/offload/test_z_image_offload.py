"""Z-Image's DiT under the offload engine: its three block containers (noise_refiner, context_refiner,
layers) stream, and LoRA training with the engine equals training without it, bitwise on CPU in fp32,
on a padded batch of two prompt lengths (the batch and mask dit_forward cuts back into the DiT's list)."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.models import get_family
from offload_tiny import assert_equal_runs, family_runs_with_and_without_engine

SPEC = get_family("z_image")


def _inputs(model):
    latents, cond = SPEC.dummy_inputs(model.config, batch=2, height=32, width=32, text_len=9)
    cond["prompt_embeds_mask"][1, 5:] = 0  # the second prompt is 5 tokens, zero-padded
    cond["prompt_embeds"][1, 5:] = 0
    return latents, torch.tensor([0.3, 0.8]), cond


@pytest.mark.parametrize("checkpoint", [False, True])
def test_z_image_lora_training_with_the_engine_is_bitwise_identical(checkpoint):
    runs, streamed = family_runs_with_and_without_engine(SPEC, _inputs, checkpoint)
    assert streamed == 4  # noise_refiner, context_refiner and layers: every block streams
    assert_equal_runs(runs)
