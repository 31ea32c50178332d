"""FLUX.2's DiT under the offload engine: its double and single blocks stream, and LoRA training with the engine
equals training without it, bitwise on CPU in fp32, on a batch of two with a reference image (tokens after the
target) and dev's guidance embedder."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.models import get_family
from diffsynth_core.offload import OffloadTrainingManager
from diffsynth_core.training.lora import resolve_lora_targets
from offload_tiny import add_lora, train

SPEC = get_family("flux2", "dev")


@pytest.mark.parametrize("checkpoint", [False, True])
def test_flux2_lora_training_with_the_engine_is_bitwise_identical(checkpoint):
    runs = []
    for engine in (False, True):
        model = SPEC.build_transformer("tiny", torch.float32, "cpu")
        torch.manual_seed(0)
        model = add_lora(model, resolve_lora_targets(model, SPEC.lora_target_modules))
        if checkpoint:
            apply_gradient_checkpointing(model, SPEC.block_container_names)
        mgr = (OffloadTrainingManager(model, "cpu", block_container_names=SPEC.block_container_names,
                                      poison_evicted=True) if engine else None)
        latents, cond = SPEC.dummy_inputs(model.config, batch=2, height=32, width=48, text_len=7, references=1)
        sigmas = torch.tensor([0.3, 0.8])
        runs.append(train(model, 3, lambda s, m: SPEC.dit_forward(model, latents + s, sigmas, cond).pow(2).mean(), mgr))
        if mgr is not None:
            blocks = sum(len(getattr(model, name)) for name in SPEC.block_container_names)
            assert mgr.report()["streamed_units"] == blocks == 3
            mgr.detach()
    (la, ga), (lb, gb) = runs
    assert len(la) == 3 and all(torch.equal(x, y) for x, y in zip(la, lb))
    assert all(len(a) > 0 and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(ga, gb))
