"""LoRA on a DiT with peft: explicit target matching, fp32 adapters, LoRA files read back.

Targets are matched as exact module names, dotted suffixes ("to_q" matches
"transformer_blocks.3.attn.to_q") or patterns with ``*`` for one name segment
("transformer_blocks.*.attn.to_q" leaves the single blocks' to_q alone), resolved here to full
names before peft sees them, so peft never interprets a target as a regex.  A target that
matches nothing is an error.

A LoRA file (diffusers', ComfyUI's, peft's or a release's own module names) is read into
``{module: (A, B, alpha)}``: continuing its training (``inject_lora_from_file``) or fusing it into
the base weights (``fuse_lora_file``) use its own rank and alpha.  Alpha comes from ``.alpha``
tensors (ComfyUI, kohya) or the header: diffusers' ``save_lora_weights`` writes the LoRA config
as ``lora_adapter_metadata`` with each key prefixed by the component (``transformer.lora_alpha``);
peft writes it unprefixed.  Without either, alpha = rank (scale 1: what ComfyUI and DiffSynth assume).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import InputError
from ..models.lora_export import FusedLinear

ADAPTER_NAME = "default"
# Component and wrapper prefixes of LoRA keys (diffusers, ComfyUI, peft).
_KEY_PREFIXES = ("transformer.", "model.diffusion_model.", "diffusion_model.", "base_model.model.")
_DOWN = (".lora_A.weight", ".lora_A.default.weight", ".lora_down.weight")
_UP = (".lora_B.weight", ".lora_B.default.weight", ".lora_up.weight")
_HEADER_KEYS = ("lora_adapter_metadata", "splitflow_lora_config")


def _target_regex(target: str) -> re.Pattern:
    """Exact name or dotted suffix, ``*`` standing for one name segment."""
    body = r"[^.]+".join(re.escape(part) for part in target.split("*"))
    return re.compile(rf"(?:.*\.)?{body}")


def resolve_lora_targets(model: nn.Module, targets: list[str] | tuple[str, ...]) -> list[str]:
    """Full names of the Linear modules that ``targets`` name (exact, dotted suffix or ``*`` pattern)."""
    linear_names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    resolved, unmatched = [], []
    for target in targets:
        pattern = _target_regex(target)
        hits = [n for n in linear_names if pattern.fullmatch(n)]
        if not hits:
            unmatched.append(target)
        resolved.extend(h for h in hits if h not in resolved)
    if unmatched:
        raise InputError(
            f"LoRA target(s) {unmatched} match no Linear module of {type(model).__name__}; "
            f"examples of valid names: {sorted({n.split('.')[-1] for n in linear_names})[:20]}"
        )
    return resolved


def _mark_adapters_trainable(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if "lora_" in name:
            # fp32 adapters over a bf16 base: peft casts the input to the adapter dtype.
            param.data = param.data.float()
            param.requires_grad_(True)


def inject_lora(model: nn.Module, targets, rank: int, alpha: float | None = None,
                init: str = "gaussian") -> dict:
    """Freeze ``model``, add a LoRA adapter on ``targets`` with fp32 weights; return its config."""
    from peft import LoraConfig, inject_adapter_in_model

    full_names = resolve_lora_targets(model, list(targets))
    _check_rank_fits(model, full_names, rank)
    alpha = float(rank if alpha is None else alpha)
    init_arg = True if init == "default" else init
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=full_names, init_lora_weights=init_arg,
                        lora_dropout=0.0)
    model.requires_grad_(False)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    _mark_adapters_trainable(model)
    return {"r": rank, "lora_alpha": alpha, "target_modules": list(targets), "init_lora_weights": init}


def _check_rank_fits(model: nn.Module, names: list[str], rank: int) -> None:
    """A rank past every target's width adds nothing a full update lacks, and 1e9 would try to allocate it."""
    modules = dict(model.named_modules())
    widest = max((min(modules[n].in_features, modules[n].out_features) for n in names
                  if isinstance(modules.get(n), nn.Linear)), default=None)
    if widest is not None and rank > widest:
        raise InputError(f"train.lora_rank = {rank} exceeds the widest target layer's rank ({widest}): a LoRA's rank "
                         f"is at most min(in, out) of its layer; use e.g. 16-128")


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """peft-format keys (``blocks.0.attn.to_q.lora_A.weight``), as the families' exporters expect."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


# --- LoRA files ----------------------------------------------------------------------------------

@dataclass
class LoraModule:
    down: torch.Tensor   # A: (r, in)
    up: torch.Tensor     # B: (out, r)
    alpha: float

    @property
    def rank(self) -> int:
        return self.down.shape[0]


def _header_config(metadata: dict[str, str]) -> dict:
    """The LoRA config in a safetensors header, with diffusers' ``transformer.`` key prefix removed."""
    for key in _HEADER_KEYS:
        if key in metadata:
            raw = json.loads(metadata[key])
            return {k.split(".", 1)[1] if k.startswith("transformer.") else k: v for k, v in raw.items()}
    return {}


def _split_key(key: str) -> tuple[str, str]:
    """``(module, part)`` with part "down", "up" or "alpha"; module keeps the file's naming."""
    for prefix in _KEY_PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    for part, suffixes in (("down", _DOWN), ("up", _UP), ("alpha", (".alpha",))):
        for suffix in suffixes:
            if key.endswith(suffix):
                return key[: -len(suffix)], part
    return key, ""


def _header_alpha(config: dict, module: str, rank: int) -> float:
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(?:.*\.)?{pattern}", module):
            return float(alpha)
    alpha = float(config.get("lora_alpha", rank))
    return alpha * math.sqrt(rank) if config.get("use_rslora") else alpha  # as an alpha/r scale


def read_lora_file(path: Path | str, modules: set[str],
                   rename: Callable[[str], str | None] | None = None) -> dict[str, LoraModule]:
    """``{diffusers module name: LoraModule}`` from a LoRA file, every key checked against ``modules``."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"LoRA file {path} not found")
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
            metadata = handle.metadata() or {}
            # DiffSynth-format files carry alpha/r in lora_A already: read at alpha = rank, as DiffSynth does
            config = {} if "splitflow_scale" in metadata else _header_config(metadata)
    except InputError:
        raise
    except Exception as err:  # safetensors' SafetensorError (a broken header, offsets past the end) and kin
        detail = " ".join(str(err).split())[:200]
        raise InputError(f"LoRA file {path} cannot be read ({type(err).__name__}: {detail}): it is incomplete "
                         "or not a safetensors file; give a whole .safetensors LoRA") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    fused: dict[str, FusedLinear] = {}  # the file's module -> the model's modules it stands for
    for key, value in tensors.items():
        module, part = _split_key(key)
        if not part:
            raise InputError(f"LoRA file {path}: key {key!r} is not a LoRA down/up weight or alpha")
        target = rename(module) if module not in modules and rename is not None else None
        if isinstance(target, FusedLinear):
            fused[module] = target
        elif target is not None:
            module = target
        if module not in modules and module not in fused:
            raise InputError(f"LoRA file {path}: key {key!r} names no module of the model")
        parts.setdefault(module, {})[part] = value
    out = {}
    for module, found in parts.items():
        if "down" not in found or "up" not in found:
            raise InputError(f"LoRA file {path}: module {module!r} lacks its lora_A (down) or lora_B (up) weight")
        rank = found["down"].shape[0]
        alpha = float(found["alpha"]) if "alpha" in found else _header_alpha(config, module, rank)
        if module in fused:
            out.update(_unfused(LoraModule(found["down"], found["up"], alpha), fused[module], modules, path, module))
        else:
            out[module] = LoraModule(found["down"], found["up"], alpha)
    if not out:
        raise InputError(f"LoRA file {path}: no lora_A/lora_B pairs found")
    return out


def _unfused(lora: LoraModule, fused: FusedLinear, modules: set[str], path: Path, name: str) -> dict[str, LoraModule]:
    """A LoRA on a fused Linear as LoRAs on its parts, the same update exactly: each part keeps the rows
    of B it owns, and the ranks whose columns there are not all zero (a block-diagonal B, as splitflow's
    own DiffSynth export writes, gives each part back its own rank; DiffSynth's dense B keeps them all).
    A part whose rows are all zero had no LoRA, unless none has one yet (an untrained file)."""
    up = lora.up
    if fused.swap_halves:
        half = up.shape[0] // 2
        up = torch.cat([up[half:], up[:half]])
    unit, left = divmod(up.shape[0], sum(fused.widths))
    if left:
        raise InputError(f"LoRA file {path}: {name}'s {up.shape[0]} outputs do not split into {list(fused.parts)}")
    rows = [up[start:start + width * unit] for start, width in zip(
        [unit * sum(fused.widths[:i]) for i in range(len(fused.widths))], fused.widths)]
    trained = [bool(b.any()) for b in rows]
    out = {}
    for part, b, has_lora in zip(fused.parts, rows, trained):
        if any(trained) and not has_lora:
            continue
        if part not in modules:
            raise InputError(f"LoRA file {path}: {name} stands for {part}, which the model lacks")
        keep = b.any(dim=0) if has_lora else torch.ones(b.shape[1], dtype=torch.bool)
        down, up_part = lora.down[keep].contiguous(), b[:, keep].contiguous()
        out[part] = LoraModule(down, up_part, lora.alpha * down.shape[0] / lora.rank)  # the same alpha / r
    return out


def _linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def fuse_lora_file(model: nn.Module, path: Path | str, scale: float = 1.0,
                   rename: Callable[[str], str | None] | None = None) -> int:
    """Fuse a LoRA file into the base weights (``W += scale * alpha/r * B @ A``); returns the module count.

    Used for differential training on top of a preset LoRA.
    """
    linears = _linear_modules(model)
    loras = read_lora_file(path, set(linears), rename)
    for module, lora in loras.items():
        weight = linears[module].weight
        delta = (lora.up.float() @ lora.down.float()) * (scale * lora.alpha / lora.rank)
        weight.data += delta.to(weight.dtype)
    return len(loras)


def inject_lora_from_file(model: nn.Module, path: Path | str,
                          rename: Callable[[str], str | None] | None = None) -> dict:
    """Freeze ``model`` and add the LoRA of ``path`` as a trainable adapter, initialised from its weights.

    Rank, alpha and targets are the file's (per module when they differ); returns the LoRA config.
    """
    from peft import LoraConfig, inject_adapter_in_model

    loras = read_lora_file(path, set(_linear_modules(model)), rename)
    names = sorted(loras)
    first = loras[names[0]]
    rank_pattern = {re.escape(m): l.rank for m, l in loras.items() if l.rank != first.rank}
    alpha_pattern = {re.escape(m): l.alpha for m, l in loras.items() if l.alpha != first.alpha}
    config = LoraConfig(r=first.rank, lora_alpha=first.alpha, target_modules=names, rank_pattern=rank_pattern,
                        alpha_pattern=alpha_pattern, lora_dropout=0.0, init_lora_weights=True)
    model.requires_grad_(False)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, lora in loras.items():
            modules[name].lora_A[ADAPTER_NAME].weight.copy_(lora.down)
            modules[name].lora_B[ADAPTER_NAME].weight.copy_(lora.up)
    _mark_adapters_trainable(model)
    result = {"r": first.rank, "lora_alpha": first.alpha, "target_modules": names, "init_lora_weights": "default"}
    if rank_pattern:
        result["rank_pattern"] = rank_pattern
    if alpha_pattern:
        result["alpha_pattern"] = alpha_pattern
    return result
