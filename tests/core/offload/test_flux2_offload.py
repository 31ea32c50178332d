"""FLUX.2's DiT under the offload engine: its double and single blocks stream, and LoRA training with the engine
equals training without it, bitwise on CPU in fp32, on a batch of two with a reference image (tokens after the
target) and dev's guidance embedder."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.models import get_family
from offload_tiny import assert_equal_runs, family_runs_with_and_without_engine

SPEC = get_family("flux2", "dev")


def _inputs(model):
    latents, cond = SPEC.dummy_inputs(model.config, batch=2, height=32, width=48, text_len=7, references=1)
    return latents, torch.tensor([0.3, 0.8]), cond


@pytest.mark.parametrize("checkpoint", [False, True])
def test_flux2_lora_training_with_the_engine_is_bitwise_identical(checkpoint):
    runs, streamed = family_runs_with_and_without_engine(SPEC, _inputs, checkpoint)
    assert streamed == 3  # the tiny DiT's double block and two single blocks: every block streams
    assert_equal_runs(runs)
