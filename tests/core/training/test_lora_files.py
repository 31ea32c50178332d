"""LoRA files read back at their own rank and alpha: --lora_checkpoint continues a LoRA, a preset
LoRA is fused at alpha/r; alpha from diffusers' header (``transformer.lora_alpha``) or ComfyUI's
``.alpha`` tensors, with alpha != r so a wrong scale cannot pass."""

from __future__ import annotations

import copy

import pytest
import torch

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family
from diffsynth_core.training.lora import fuse_lora_file, inject_lora, lora_state_dict, read_lora_file
from diffsynth_core.training.prepare import prepare_for_training
from stages.config import OffloadSection, TrainSection

RANK, ALPHA = 4, 12.0


def _trained_lora(family: str, out_dir):
    """A tiny DiT with a LoRA (rank 4, alpha 12, random B so it changes outputs), exported by the family."""
    spec = get_family(family)
    torch.manual_seed(0)
    base = spec.build_transformer("tiny", torch.float32, "cpu")
    tuned = copy.deepcopy(base)
    config = inject_lora(tuned, spec.lora_target_modules, RANK, ALPHA)
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    paths = spec.export_lora(lora_state_dict(tuned), config, out_dir)
    return spec, base, tuned, paths


def _output(spec, model):
    latents, cond = spec.dummy_inputs(dict(model.config), batch=1, height=32, width=32, text_len=8, seed=1)
    with torch.no_grad():
        return spec.dit_forward(model, latents, torch.tensor([0.5]), cond)


@pytest.mark.parametrize("family,file", [("qwen_image", "diffusers"), ("qwen_image", "comfyui"),
                                         ("wan", "comfyui")])
def test_a_preset_lora_is_fused_at_its_own_alpha(family, file, tmp_path):
    spec, base, tuned, paths = _trained_lora(family, tmp_path)
    fused = copy.deepcopy(base)
    count = fuse_lora_file(fused, paths[file], rename=spec.native_module_name)
    assert count == len({k.rsplit(".lora_", 1)[0] for k in lora_state_dict(tuned)})
    torch.testing.assert_close(_output(spec, fused), _output(spec, tuned), rtol=1e-4, atol=1e-5)


def test_the_diffusers_header_alpha_is_prefixed_by_the_component(tmp_path):
    from safetensors import safe_open

    spec, base, _, paths = _trained_lora("qwen_image", tmp_path)
    with safe_open(str(paths["diffusers"]), "pt") as handle:  # what diffusers' save_lora_weights writes
        assert '"transformer.lora_alpha": 12.0' in handle.metadata()["lora_adapter_metadata"]
    modules = {name for name, _ in base.named_modules()}
    assert {lora.alpha for lora in read_lora_file(paths["diffusers"], modules).values()} == {ALPHA}


@pytest.mark.parametrize("family,file", [("qwen_image", "diffusers"), ("wan", "comfyui"), ("wan", "diffusers")])
def test_lora_checkpoint_continues_that_lora(family, file, tmp_path):
    spec, base, tuned, paths = _trained_lora(family, tmp_path)
    train = TrainSection(lora_checkpoint=str(paths[file]), lora_rank=16, lora_alpha=None, gradient_checkpointing=False)
    model = copy.deepcopy(base)
    prepared = prepare_for_training(model, spec, train, OffloadSection(), torch.device("cpu"))
    assert (prepared.lora_config["r"], prepared.lora_config["lora_alpha"]) == (RANK, ALPHA)  # the file's, not 16
    ours, theirs = lora_state_dict(prepared.model), lora_state_dict(tuned)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert all(p.requires_grad for n, p in prepared.model.named_parameters() if "lora_" in n)
    prepared.model.eval()
    torch.testing.assert_close(_output(spec, prepared.model), _output(spec, tuned), rtol=0, atol=0)


def test_a_lora_file_for_another_model_names_the_key(tmp_path):
    _, _, _, paths = _trained_lora("wan", tmp_path)
    qwen = get_family("qwen_image").build_transformer("tiny", torch.float32, "cpu")
    with pytest.raises(InputError, match="names no module of the model"):
        fuse_lora_file(qwen, paths["diffusers"])
