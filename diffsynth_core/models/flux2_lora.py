"""FLUX.2 LoRA files under BFL's module names, as ComfyUI, musubi-tuner and diffusers read them.

ComfyUI keeps FLUX.2's DiT under BFL's names (``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1``)
and maps every ``lora_unet_<name with _ for .>`` key onto the weight ``diffusion_model.<name>`` (comfy/lora.py
``model_lora_keys_unet``, its generic part), reading ``lora_down``/``lora_up`` and ``.alpha`` (scale alpha/rank).
musubi-tuner writes FLUX.2 LoRAs that way (networks/lora_flux_2.py, prefix ``lora_unet``) and diffusers reads
them back (``_convert_kohya_flux2_lora_to_diffusers``).  BFL fuses each stream's q, k and v: their three LoRAs
become one whose A is stacked and B block-diagonal (rank 3r, alpha 3·alpha: the same alpha/rank), which
diffusers splits back exactly.  ``native_module_name`` reads such files (and BFL-dotted ones) back onto the
diffusers modules, so a LoRA trained elsewhere in these names continues here.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from . import lora_export
from .flux2_released import FUSED_PARTS, SWAPPED, bfl_module, swap_halves
from .lora_export import FusedLinear

KOHYA_PREFIX = "lora_unet_"


def kohya_name(bfl: str) -> str:
    return KOHYA_PREFIX + bfl.replace(".", "_")


def _scaled(down: torch.Tensor, factor: float) -> torch.Tensor:
    return down if factor == 1 else down * factor


def comfyui_state_dict(peft_state_dict: dict[str, torch.Tensor],
                       lora_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``lora_unet_<BFL name>.lora_down/lora_up.weight`` + ``.alpha`` for every LoRA module (module docstring)."""
    fused: dict[str, dict[int, tuple[str, torch.Tensor, torch.Tensor, float]]] = {}
    out: dict[str, torch.Tensor] = {}
    for module in lora_export.lora_modules(peft_state_dict):
        down = peft_state_dict[module + ".lora_A.weight"].detach()
        up = peft_state_dict[module + ".lora_B.weight"].detach()
        alpha = lora_export.comfy_alpha(lora_config, down.shape[0], module)
        target = bfl_module(module)
        if target is None:
            raise ValueError(f"no BFL (ComfyUI) module for LoRA on {module}")
        name, part = target
        if part is not None:
            fused.setdefault(name, {})[part] = (module, down, up, alpha / down.shape[0])
            continue
        _put(out, name, down, swap_halves(up) if module == SWAPPED else up, alpha)
    for name, parts in fused.items():
        scale = next(iter(parts.values()))[3]  # one alpha/rank for the fused Linear: the others fold into A
        members = [None if i not in parts else (_scaled(parts[i][1], parts[i][3] / scale), parts[i][2])
                   for i in range(FUSED_PARTS)]
        width = next(p[2].shape[0] for p in parts.values())
        down, up = lora_export.fuse_pairs(members, [width] * FUSED_PARTS)
        _put(out, name, down, up, scale * down.shape[0])
    return out


def _put(out: dict, name: str, down: torch.Tensor, up: torch.Tensor, alpha: float) -> None:
    key = kohya_name(name)
    out[key + ".lora_down.weight"] = down.contiguous()
    out[key + ".lora_up.weight"] = up.contiguous()
    out[key + ".alpha"] = torch.tensor(alpha, dtype=torch.float32)


# --- reading BFL-named LoRAs back -----------------------------------------------------------------

_BLOCK_NAME = re.compile(r"^(double_blocks|single_blocks)[._](\d+)[._](.+)$")
# BFL module (dotted) -> diffusers module, per place; fused ones -> their q, k, v parts
_DOUBLE = {"img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.linear_in",
           "img_mlp.2": "ff.linear_out", "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out"}
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
_ROOT = {bfl_module(m)[0]: m for m in (
    "x_embedder", "context_embedder", "proj_out", "time_guidance_embed.timestep_embedder.linear_1",
    "time_guidance_embed.timestep_embedder.linear_2", "time_guidance_embed.guidance_embedder.linear_1",
    "time_guidance_embed.guidance_embedder.linear_2", "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.linear", "single_stream_modulation.linear", SWAPPED)}


def _dotted(rest: str, names) -> str | None:
    """A BFL name as written (dotted, or kohya's underscores) -> the dotted name among ``names``."""
    return next((name for name in names if rest in (name, name.replace(".", "_"))), None)


def native_module_name(name: str) -> str | FusedLinear | None:
    """The diffusers module(s) of a DiT module named as BFL names it (``double_blocks.0.img_attn.qkv``, or
    musubi/kohya's ``lora_unet_double_blocks_0_img_attn_qkv``); None: not such a name."""
    name = name.removeprefix(KOHYA_PREFIX)
    root = _dotted(name, _ROOT)
    if root is not None:
        module = _ROOT[root]
        return FusedLinear((module,), (1,), swap_halves=True) if module == SWAPPED else module
    match = _BLOCK_NAME.match(name)
    if match is None:
        return None
    container, index, rest = match.groups()
    if container == "single_blocks":
        found = _dotted(rest, _SINGLE)
        return f"single_transformer_blocks.{index}.{_SINGLE[found]}" if found else None
    prefix = f"transformer_blocks.{index}."
    found = _dotted(rest, _DOUBLE)
    if found:
        return prefix + _DOUBLE[found]
    found = _dotted(rest, _DOUBLE_FUSED)
    if found:
        return FusedLinear(tuple(prefix + part for part in _DOUBLE_FUSED[found]), (1,) * FUSED_PARTS)
    return None
