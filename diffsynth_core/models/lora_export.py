"""Writing trained LoRA weights as files that diffusers, ComfyUI and DiffSynth-Studio load fully.

Input is always peft's ``get_peft_model_state_dict(transformer)``: keys such as
``transformer_blocks.0.attn.to_q.lora_A.weight`` (diffusers module names).  One training run
gives one file per consumer, because no single key layout serves all three:

* ``<stem>.safetensors`` (diffusers): ``transformer.<module>.lora_A/B.weight``, written by the
  family pipeline's own ``save_lora_weights`` with the LoRA config in the header
  (``lora_adapter_metadata``), so ``pipe.load_lora_weights`` restores the exact scale alpha/r.
* ``<stem>_comfyui.safetensors``: ComfyUI ignores the header and reads one ``<key>.alpha`` per
  module (scale 1 without it); the key names come from the family (ComfyUI's own names, or
  diffusers names where ComfyUI maps them itself).
* ``<stem>_diffsynth.safetensors``: DiffSynth-Studio's ``GeneralLoRALoader`` strips only
  ``diffusion_model.`` and fuses ``B @ A`` into modules of *its* DiT, so keys carry DiffSynth's
  module names (fused q/k/v layers get block-diagonal pairs) and the scale alpha/r is folded
  into ``lora_A``: what DiffSynth's own trainer writes (no alpha, scale 1).

Every file is written deterministically (sorted header, no timestamps, temp file + rename), so
the same weights give byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

DIFFUSERS_FILE = "lora.safetensors"
CONSUMER_SUFFIXES = {"diffusers": "", "comfyui": "_comfyui", "diffsynth": "_diffsynth"}
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

# (lora_A (r, in), lora_B (out, r)) of one module; in DiffSynth files A already carries the scale.
Pair = tuple[torch.Tensor, torch.Tensor]


def file_names(stem: str = "lora") -> dict[str, str]:
    """Consumer -> file name: ``lora.safetensors``, ``lora_comfyui.safetensors``, ..."""
    return {consumer: f"{stem}{suffix}.safetensors" for consumer, suffix in CONSUMER_SUFFIXES.items()}


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


# --- deterministic safetensors ------------------------------------------------------------------

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Path:
    """A safetensors file whose bytes depend only on names, tensors and metadata.

    safetensors' own writer serialises its metadata map in hash order (byte-different files
    for equal content); here the header is JSON with sorted keys, padded so the data start on
    a 64-byte boundary, and tensors whose sizes are multiples of 64 bytes come first, so
    loaders that map the file (ComfyUI's mmap loader) see tensors aligned like torch's own
    allocations.  The file appears by an atomic rename.
    """
    def order_key(name: str):
        t = tensors[name]
        return -t.element_size(), (t.numel() * t.element_size()) % 64 != 0, name

    order = sorted(tensors, key=order_key)
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, offset = [], 0
    for name in order:
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 64)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves no half file in the output folder
        raise
    return path


def _remove_stale_temporaries(path: Path) -> None:
    """``.<name>.tmp-PID`` files a killed writer left beside ``path`` (its PID is gone): removed."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        pid = stale.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            stale.unlink(missing_ok=True)
        except PermissionError:  # another user's live process
            pass


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, dict(handle.metadata() or {})


# --- the three files ----------------------------------------------------------------------------

def save_diffusers_lora(pipeline_cls: type, peft_state_dict: dict[str, torch.Tensor],
                        lora_config: dict[str, Any], out_dir: Path, name: str = DIFFUSERS_FILE) -> Path:
    """Write ``out_dir/name`` as the pipeline's own ``save_lora_weights`` does, then canonicalise
    its bytes (diffusers stays the authority on keys and header; we only fix the order)."""
    modules = lora_modules(peft_state_dict)
    _check_rank(peft_state_dict, lora_config)
    metadata = adapter_metadata(lora_config, modules)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in peft_state_dict.items()}
    scratch = Path(tempfile.mkdtemp(prefix=".lora-", dir=out_dir))
    try:
        pipeline_cls.save_lora_weights(scratch, transformer_lora_layers=tensors, weight_name=name,
                                       transformer_lora_adapter_metadata=metadata)
        written, header = _read_safetensors(scratch / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return write_safetensors(out_dir / name, written, header)


def comfy_alpha(lora_config: dict[str, Any], rank: int, module: str = "") -> float:
    """The ``.alpha`` that gives a single-alpha loader (scale = alpha / rank) peft's scale for
    ``module``: its ``alpha_pattern`` entry if any (matched as peft matches it), rsLoRA included."""
    from peft.utils.other import get_pattern_key

    alpha = float(lora_config["lora_alpha"])
    patterns = lora_config.get("alpha_pattern") or {}
    key = get_pattern_key(list(patterns), module) if patterns else None
    if key in patterns:
        alpha = float(patterns[key])
    if lora_config.get("use_rslora"):
        return alpha * math.sqrt(rank)  # peft scale alpha/sqrt(r) == (alpha*sqrt(r))/r
    return alpha


def needs_alpha_tensors(lora_config: dict[str, Any]) -> bool:
    """True when a loader's default scale (1) differs from peft's, i.e. alpha != r or rsLoRA."""
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
        out[name + ".alpha"] = torch.tensor(comfy_alpha(lora_config, down.shape[0], module), dtype=torch.float32)
    return out


def scaled_pairs(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any]) -> dict[str, Pair]:
    """Module -> (scale * A, B): the pair whose plain product ``B @ A`` is peft's update."""
    pairs = {}
    for module in lora_modules(peft_state_dict):
        down = peft_state_dict[module + ".lora_A.weight"].detach()
        scale = comfy_alpha(lora_config, down.shape[0], module) / down.shape[0]
        pairs[module] = (down * scale if scale != 1 else down, peft_state_dict[module + ".lora_B.weight"].detach())
    return pairs


def renamed(rename: Callable[[str], str]) -> Callable[[dict[str, Pair]], dict[str, Pair]]:
    """A DiffSynth layout that only renames modules (families whose DiT keeps one Linear per module)."""
    return lambda pairs: {rename(module): pair for module, pair in pairs.items()}


@dataclass(frozen=True)
class FusedLinear:
    """A Linear of another layout that is several of the model's (DiffSynth's FLUX ``a_to_qkv``): its output
    rows are ``parts`` in order, ``widths`` in units of the first; ``swap_halves``: its two output halves are
    swapped (DiffSynth's ``final_norm_out``).  A family's ``native_module_name`` may return one."""

    parts: tuple[str, ...]
    widths: tuple[int, ...]
    swap_halves: bool = False


def fuse_pairs(parts: list[Pair | None], widths: list[int]) -> Pair:
    """One pair for a Linear that fuses several (q, k, v[, mlp]): A stacked, B block-diagonal.

    ``parts[i]`` is the pair of the i-th fused output slice (None: that slice has no LoRA and
    gets rank 0); ``widths[i]`` its output width.  ``B @ A`` is then the per-slice updates stacked.
    """
    present = [p for p in parts if p is not None]
    if not present:
        raise ValueError("fuse_pairs needs at least one LoRA pair")
    ref_a, ref_b = present[0]
    a_blocks, ranks = [], []
    for part in parts:
        a = part[0] if part is not None else ref_a.new_zeros((0, ref_a.shape[1]))
        a_blocks.append(a)
        ranks.append(a.shape[0])
    fused_b = ref_b.new_zeros((sum(widths), sum(ranks)))
    row, col = 0, 0
    for part, width, rank in zip(parts, widths, ranks):
        if part is not None:
            if part[1].shape[0] != width:
                raise ValueError(f"fused slice has {part[1].shape[0]} outputs, expected {width}")
            fused_b[row:row + width, col:col + rank] = part[1]
        row, col = row + width, col + rank
    return torch.cat(a_blocks), fused_b


def diffsynth_state_dict(pairs: dict[str, Pair]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (down, up) in pairs.items():
        out[name + ".lora_A.weight"] = down.contiguous()
        out[name + ".lora_B.weight"] = up.contiguous()
    return out


def _header(lora_config: dict[str, Any]) -> dict[str, str]:
    # Not diffusers' "lora_adapter_metadata" key: its loader would read it as a prefixed config.
    config = json.dumps(adapter_metadata(lora_config, None), sort_keys=True)
    return {"format": "pt", "splitflow_lora_config": config}


def export_lora_files(pipeline_cls: type, peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                      out_dir: Path, *, diffsynth_layout: Callable[[dict[str, Pair]], dict[str, Pair]],
                      comfyui_name: Callable[[str], str] | None = None,
                      comfyui_state_dict: Callable[[dict, dict], dict[str, torch.Tensor]] | None = None,
                      stem: str = "lora") -> dict[str, Path]:
    """Write the diffusers, ComfyUI and DiffSynth files of one LoRA; returns consumer -> path.

    ``comfyui_name(module)`` is the ComfyUI key of a diffusers module, or ``comfyui_state_dict(peft state
    dict, lora_config)`` the whole ComfyUI file where ComfyUI's layers fuse several of the model's (FLUX.2);
    ``diffsynth_layout`` maps ``{module: scaled pair}`` onto DiffSynth's module names (renaming, fusing).
    """
    if (comfyui_name is None) == (comfyui_state_dict is None):
        raise ValueError("give exactly one of comfyui_name and comfyui_state_dict")
    out_dir, names = Path(out_dir), file_names(stem)
    paths = {"diffusers": save_diffusers_lora(pipeline_cls, peft_state_dict, lora_config, out_dir,
                                              names["diffusers"])}
    header = _header(lora_config)
    comfy = (comfyui_state_dict(peft_state_dict, lora_config) if comfyui_state_dict is not None
             else comfy_state_dict(peft_state_dict, lora_config, comfyui_name))
    paths["comfyui"] = write_safetensors(out_dir / names["comfyui"], comfy, header)
    diffsynth = diffsynth_state_dict(diffsynth_layout(scaled_pairs(peft_state_dict, lora_config)))
    paths["diffsynth"] = write_safetensors(out_dir / names["diffsynth"], diffsynth,
                                           {**header, "splitflow_scale": "folded into lora_A"})
    return paths
