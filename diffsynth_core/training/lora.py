"""LoRA on a DiT with peft: explicit target matching, fp32 adapters, preset-LoRA fusing.

Targets are matched as exact module names or dotted suffixes ("to_q" matches
"transformer_blocks.3.attn.to_q"), resolved here to full names before peft sees them, so peft
never interprets a target as a regex.  A target that matches nothing is an error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from ..errors import InputError

ADAPTER_NAME = "default"


def resolve_lora_targets(model: nn.Module, targets: list[str] | tuple[str, ...]) -> list[str]:
    """Full names of the Linear modules that ``targets`` name (exact or dotted suffix)."""
    linear_names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    resolved, unmatched = [], []
    for target in targets:
        hits = [n for n in linear_names if n == target or n.endswith("." + target)]
        if not hits:
            unmatched.append(target)
        resolved.extend(h for h in hits if h not in resolved)
    if unmatched:
        raise InputError(
            f"LoRA target(s) {unmatched} match no Linear module of {type(model).__name__}; "
            f"examples of valid names: {sorted({n.split('.')[-1] for n in linear_names})[:20]}"
        )
    return resolved


def inject_lora(model: nn.Module, targets, rank: int, alpha: float | None = None,
                init: str = "gaussian") -> dict:
    """Freeze ``model``, add a LoRA adapter on ``targets`` with fp32 weights; return its config."""
    from peft import LoraConfig, inject_adapter_in_model

    full_names = resolve_lora_targets(model, list(targets))
    alpha = float(rank if alpha is None else alpha)
    init_arg = True if init == "default" else init
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=full_names, init_lora_weights=init_arg,
                        lora_dropout=0.0)
    model.requires_grad_(False)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        if "lora_" in name:
            # fp32 adapters over a bf16 base: peft casts the input to the adapter dtype.
            param.data = param.data.float()
            param.requires_grad_(True)
    return {"r": rank, "lora_alpha": alpha, "target_modules": list(targets), "init_lora_weights": init}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """peft-format keys (``blocks.0.attn.to_q.lora_A.weight``), as the families' exporters expect."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def fuse_lora_file(model: nn.Module, path: Path | str, scale: float = 1.0) -> int:
    """Fuse a diffusers/peft-format LoRA file into the base weights (W += s * alpha/r * B @ A).

    Used for differential training on top of a preset LoRA.  Returns the number of fused
    modules; keys that name no module are an error naming the key and file.
    """
    import json

    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        metadata = handle.metadata() or {}
    alpha_by_rank = json.loads(metadata.get("lora_adapter_metadata", "{}")).get("lora_alpha")
    modules = dict(model.named_modules())
    fused = 0
    for key, down in tensors.items():
        if ".lora_A." not in key:
            continue
        module_name = key.split(".lora_A.")[0].removeprefix("transformer.").removeprefix("diffusion_model.")
        if module_name not in modules:
            raise InputError(f"preset LoRA {path}: key {key!r} names no module of the model")
        up = tensors[key.replace(".lora_A.", ".lora_B.")]
        alpha_key = key.split(".lora_A.")[0] + ".alpha"
        rank = down.shape[0]
        alpha = float(tensors[alpha_key]) if alpha_key in tensors else float(alpha_by_rank or rank)
        weight = modules[module_name].weight
        delta = (up.float() @ down.float()) * (scale * alpha / rank)
        weight.data += delta.to(weight.dtype)
        fused += 1
    if fused == 0:
        raise InputError(f"preset LoRA {path}: no lora_A/lora_B pairs found")
    return fused
