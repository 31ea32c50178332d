"""`--lora_checkpoint` continues a FLUX LoRA from either source: splitflow's files (diffusers keys or its
DiffSynth-layout ``lora_diffsynth.safetensors``, q/k/v fused block-diagonally) and a DiffSynth-trained file
(one dense LoRA on each fused ``a_to_qkv``); the continued adapters hold exactly the file's update, and a
file naming no module is refused before preprocessing starts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family
from diffsynth_core.training.lora import inject_lora, inject_lora_from_file, lora_state_dict
from stages.config import build_config

RANK = 4


def _deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each adapted Linear's update scale * B @ A, by diffusers module name."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            scale = module.scaling["default"]
            out[name] = scale * module.lora_B["default"].weight @ module.lora_A["default"].weight
    return out


@pytest.fixture(scope="module")
def flux():
    spec = get_family("flux")
    model = spec.build_transformer("tiny", torch.float32, "cpu")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    config = inject_lora(model, linears, RANK, 8.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return spec, lora_state_dict(model), config, _deltas(model)


@pytest.mark.parametrize("consumer", ["diffusers", "diffsynth"])
def test_splitflows_own_flux_files_continue_with_the_same_update(flux, tmp_path, consumer):
    spec, peft_sd, config, truth = flux
    paths = spec.export_lora(peft_sd, config, tmp_path)
    fresh = spec.build_transformer("tiny", torch.float32, "cpu")
    continued = inject_lora_from_file(fresh, paths[consumer], spec.native_module_name)
    got = _deltas(fresh)
    assert got.keys() == truth.keys()
    for name in truth:
        torch.testing.assert_close(got[name], truth[name], rtol=1e-5, atol=1e-6)
    assert continued["r"] == RANK and not continued.get("rank_pattern")  # each part back at its own rank


def test_a_diffsynth_trained_flux_lora_continues_with_its_dense_fused_update(tmp_path):
    spec = get_family("flux")
    fresh = spec.build_transformer("tiny", torch.float32, "cpu")
    inner = fresh.transformer_blocks[0].attn.to_q.out_features
    width = fresh.transformer_blocks[0].attn.to_q.in_features
    g = torch.Generator().manual_seed(1)
    down, up = torch.randn(RANK, width, generator=g), torch.randn(3 * inner, RANK, generator=g)
    # DiffSynth's names after remove_prefix_in_ckpt "pipe.dit.", peft's adapter "default", no alpha: alpha = rank
    file = tmp_path / "epoch-0.safetensors"
    save_file({"blocks.0.attn.a_to_qkv.lora_A.default.weight": down,
               "blocks.0.attn.a_to_qkv.lora_B.default.weight": up}, str(file))
    inject_lora_from_file(fresh, file, spec.native_module_name)
    got = _deltas(fresh)
    fused = up @ down
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        torch.testing.assert_close(got[f"transformer_blocks.0.attn.{part}"], fused[i * inner:(i + 1) * inner])
    assert sorted(got) == [f"transformer_blocks.0.attn.{p}" for p in ("to_k", "to_q", "to_v")]


def test_a_lora_checkpoint_naming_no_module_is_refused_before_preprocessing(tmp_path, monkeypatch):
    from flows import orchestrate
    from stages.demo import write_demo_model

    model = write_demo_model(tmp_path / "model", "flux")
    file = tmp_path / "other.safetensors"
    save_file({"blocks.0.attn.nothing.lora_A.weight": torch.zeros(RANK, 8),
               "blocks.0.attn.nothing.lora_B.weight": torch.zeros(8, RANK)}, str(file))
    cfg = build_config({"model": {"family": "flux", "path": str(model)}, "train": {"lora_checkpoint": str(file)},
                        "output": {"path": str(tmp_path / "out")}})
    with pytest.raises(InputError, match="names no module of the model"):
        orchestrate.check_lora_targets_first(cfg, ("preprocess", "train"), local=True)
