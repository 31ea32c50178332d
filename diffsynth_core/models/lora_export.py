"""Writing trained LoRA weights as files that diffusers and ComfyUI load.

Input is always peft's ``get_peft_model_state_dict(transformer)``: keys such as
``transformer_blocks.0.attn.to_q.lora_A.weight`` (diffusers module names).

* diffusers format: ``transformer.<module>.lora_A/B.weight`` written by the family pipeline's
  own ``save_lora_weights``, with the LoRA config in the header (``lora_adapter_metadata``),
  so ``pipe.load_lora_weights(dir, weight_name=...)`` restores the exact scale alpha/r.
* ComfyUI format: ComfyUI ignores the header and reads ``<prefix>.alpha`` tensors (scale 1
  without them), so its file carries one ``.alpha`` per module; key names come from the family.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

DIFFUSERS_FILE = "lora.safetensors"
COMFYUI_FILE = "lora_comfyui.safetensors"
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def lora_modules(peft_state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Module names that carry a LoRA pair; any other key, or half a pair, is an error naming it."""
    modules: dict[str, set[str]] = {}
    for key in peft_state_dict:
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"LoRA state dict key {key!r} does not end in .lora_A.weight or .lora_B.weight")
        modules.setdefault(key[: -len(suffix)], set()).add(suffix)
    for module, found in modules.items():
        if len(found) != 2:
            raise ValueError(f"LoRA module {module!r} has only {sorted(found)}; both lora_A and lora_B are needed")
    if not modules:
        raise ValueError("the LoRA state dict is empty")
    return sorted(modules)


def adapter_metadata(lora_config: dict[str, Any], modules: list[str] | None = None) -> dict[str, Any]:
    """The full peft ``LoraConfig`` as a dict: what diffusers stores in the header and rebuilds on load.

    ``target_modules`` becomes the exact module list when given (no suffix or regex guessing on
    reload), and ``init_lora_weights`` is ``True``: the weights are overwritten on load anyway,
    while initialisations such as PiSSA/OLoRA would rewrite the *base* weights when reloaded.
    """
    from peft import LoraConfig

    for key in ("r", "lora_alpha", "target_modules"):
        if key not in lora_config:
            raise ValueError(f"lora_config is missing {key!r} (got {sorted(lora_config)})")
    values = dict(lora_config, init_lora_weights=True)
    if modules is not None:
        values["target_modules"] = list(modules)
    try:
        config = LoraConfig(**values).to_dict()
    except TypeError as exc:
        raise ValueError(f"lora_config has a key peft's LoraConfig does not know: {exc}") from exc
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def _check_rank(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any]) -> None:
    if lora_config.get("rank_pattern"):
        return
    for key, value in peft_state_dict.items():
        if key.endswith(".lora_A.weight") and value.shape[0] != int(lora_config["r"]):
            raise ValueError(f"{key} has rank {value.shape[0]} but lora_config says r={lora_config['r']}")


def save_diffusers_lora(pipeline_cls: type, peft_state_dict: dict[str, torch.Tensor],
                        lora_config: dict[str, Any], out_dir: Path) -> Path:
    """Write ``out_dir/lora.safetensors`` with the pipeline's own ``save_lora_weights``."""
    modules = lora_modules(peft_state_dict)
    _check_rank(peft_state_dict, lora_config)
    metadata = adapter_metadata(lora_config, modules)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in peft_state_dict.items()}
    pipeline_cls.save_lora_weights(out_dir, transformer_lora_layers=tensors, weight_name=DIFFUSERS_FILE,
                                   transformer_lora_adapter_metadata=metadata)
    return out_dir / DIFFUSERS_FILE


def comfy_alpha(lora_config: dict[str, Any], rank: int) -> float:
    """The ``.alpha`` that gives ComfyUI (scale = alpha / rank) peft's scale for this rank."""
    if lora_config.get("alpha_pattern") or lora_config.get("rank_pattern"):
        raise ValueError("alpha_pattern/rank_pattern LoRAs cannot be exported to ComfyUI's single-alpha format")
    alpha = float(lora_config["lora_alpha"])
    if lora_config.get("use_rslora"):
        return alpha * math.sqrt(rank)  # peft scale alpha/sqrt(r) == (alpha*sqrt(r))/r
    return alpha


def needs_alpha_tensors(lora_config: dict[str, Any]) -> bool:
    """True when ComfyUI's default scale (1) differs from peft's, i.e. alpha != r or rsLoRA."""
    return bool(lora_config.get("use_rslora")) or float(lora_config["lora_alpha"]) != float(lora_config["r"])


def comfy_state_dict(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                     rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """``rename(module)`` + ``.lora_A.weight`` / ``.lora_B.weight`` / ``.alpha`` for every LoRA module."""
    out: dict[str, torch.Tensor] = {}
    for module in lora_modules(peft_state_dict):
        down = peft_state_dict[module + ".lora_A.weight"]
        name = rename(module)
        out[name + ".lora_A.weight"] = down.detach().contiguous()
        out[name + ".lora_B.weight"] = peft_state_dict[module + ".lora_B.weight"].detach().contiguous()
        out[name + ".alpha"] = torch.tensor(comfy_alpha(lora_config, down.shape[0]), dtype=torch.float32)
    return out


def save_comfy_lora(state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any], out_dir: Path) -> Path:
    """Write ``out_dir/lora_comfyui.safetensors`` (the LoRA config also goes in the header, for people)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / COMFYUI_FILE
    # Not diffusers' "lora_adapter_metadata" key: its loader would read it as a prefixed config.
    metadata = {"format": "pt", "splitflow_lora_config": json.dumps(adapter_metadata(lora_config, None))}
    save_file(state_dict, str(path), metadata=metadata)
    return path


def export_with_alpha_file(pipeline_cls, peft_state_dict: dict[str, torch.Tensor], lora_config: dict,
                           out_dir: Path, comfy_prefix: str) -> dict[str, Path]:
    """The diffusers file, plus a ComfyUI file (``<comfy_prefix><name>`` keys and ``.alpha`` tensors)
    only when alpha != r: for families whose diffusers names ComfyUI already reads, the one thing
    it misses is the alpha in the header."""
    paths = {"diffusers": save_diffusers_lora(pipeline_cls, peft_state_dict, lora_config, out_dir)}
    if needs_alpha_tensors(lora_config):
        state_dict = comfy_state_dict(peft_state_dict, lora_config, lambda name: comfy_prefix + name)
        paths["comfyui"] = save_comfy_lora(state_dict, lora_config, out_dir)
    return paths
