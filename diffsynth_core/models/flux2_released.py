"""FLUX.2 as released: diffusers subfolders (also as DiffSynth-Studio downloads them) and BFL's single files.

* ``black-forest-labs/FLUX.2-dev`` and ``FLUX.2-klein-{4B,9B}`` / ``FLUX.2-klein-base-{4B,9B}``:
  ``transformer/`` (``Flux2Transformer2DModel``), ``vae/`` (``AutoencoderKLFlux2``) and ``text_encoder/``
  (Mistral-Small-3.2 for dev, Qwen3-4B / Qwen3-8B for klein) in the diffusers/transformers layout.
  DiffSynth's patterns (``FLUX.2-dev:text_encoder/*.safetensors`` ...) fetch the weights without
  ``config.json``, so configs come from the shapes plus the releases' fixed facts.
* BFL's single DiT files (``flux2-dev.safetensors``, ``flux-2-klein-4b.safetensors``, ComfyUI's copies):
  the original names (``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1``, ...), converted
  by diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` (any width).
* The VAE: ``flux2_vae_released`` (diffusers names; BFL's ``ae.safetensors`` and ComfyUI's
  ``flux2-vae.safetensors`` names).
* Mistral's text encoder is loaded as its text decoder alone (``MistralModel``): encoding reads only its
  hidden states, so the vision tower, projector and LM head are never read.

``bfl_module`` is the diffusers -> BFL module map (the inverse of that converter), which the
ComfyUI LoRA export and the test fixtures use.  ``variant_of`` and ``encoders_variant`` tell the variants
apart from the files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from . import flux2_vae_released
from .loading import read_model_index_file
from .released import ReleasedFormat, count_indices
from .weight_files import Shapes, StateDict, read_shapes

# The release's facts that are not in the weights' shapes (black-forest-labs/FLUX.2-dev transformer/config.json;
# the klein releases share them).
DIT_FACTS = dict(patch_size=1, rope_theta=2000, eps=1e-6)

# --- the DiT: diffusers module -> BFL module -------------------------------------------------------

_ROOT = {
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # BFL keeps (shift, scale), diffusers (scale, shift)
}
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2",
}
# BFL fuses each stream's q, k, v into one Linear: part index in its output rows
_DOUBLE_FUSED = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
                 "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
                 "attn.add_v_proj": ("txt_attn.qkv", 2)}
_DOUBLE_NORMS = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                 "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_SINGLE_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
SWAPPED = "norm_out.linear"
FUSED_PARTS = 3
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def bfl_module(module: str) -> tuple[str, int | None] | None:
    """``(BFL module, part)`` of a diffusers module of ``Flux2Transformer2DModel`` (part: its slice of a
    fused q/k/v Linear, else None); norms map too (``attn.norm_q`` -> ``img_attn.norm.query_norm``).
    None: not a module of the DiT."""
    if module in _ROOT:
        return _ROOT[module], None
    match = _BLOCK.match(module)
    if match is None:
        return None
    container, index, rest = match.groups()
    if container == "transformer_blocks":
        prefix = f"double_blocks.{index}."
        if rest in _DOUBLE_FUSED:
            name, part = _DOUBLE_FUSED[rest]
            return prefix + name, part
        table = {**_DOUBLE, **_DOUBLE_NORMS}
    else:
        prefix, table = f"single_blocks.{index}.", {**_SINGLE, **_SINGLE_NORMS}
    return (prefix + table[rest], None) if rest in table else None


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def diffusers_to_bfl(state: StateDict) -> StateDict:
    """``Flux2Transformer2DModel`` weights under BFL's names (how flux2-dev.safetensors holds them; fixtures)."""
    out: StateDict = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        module, param = key.rsplit(".", 1)
        target = bfl_module(module)
        if target is None:
            raise KeyError(f"no BFL name for {key}")
        name, part = target
        suffix = "scale" if "norm" in name.rsplit(".", 1)[-1] and param == "weight" else param
        if part is not None:
            fused.setdefault(f"{name}.{suffix}", {})[part] = value
        else:
            out[f"{name}.{suffix}"] = swap_halves(value) if module == SWAPPED else value
    for name, parts in fused.items():
        out[name] = torch.cat([parts[i] for i in range(FUSED_PARTS)], dim=0)
    return out


def bfl_to_diffusers(state: StateDict) -> StateDict:
    """BFL names -> ``Flux2Transformer2DModel`` names, with diffusers' own converter."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers(dict(state))


def _dit_config(inner: int, in_channels: int, out_channels: int, head_dim: int, layers: int, single: int,
                joint: int, mlp_hidden: int, time_channels: int, guidance: bool) -> dict[str, Any]:
    return dict(DIT_FACTS, in_channels=in_channels, out_channels=None if out_channels == in_channels else out_channels,
                num_layers=layers, num_single_layers=single, attention_head_dim=head_dim,
                num_attention_heads=inner // head_dim, joint_attention_dim=joint, mlp_ratio=mlp_hidden / inner,
                timestep_guidance_channels=time_channels, guidance_embeds=guidance,
                axes_dims_rope=[head_dim // 4] * 4)  # (32, 32, 32, 32) at head_dim 128: T, H, W, L


def _diffusers_dit_config(s: Shapes) -> dict[str, Any]:
    inner, in_channels = s["x_embedder.weight"]
    return _dit_config(inner, in_channels, s["proj_out.weight"][0], s["transformer_blocks.0.attn.norm_q.weight"][0],
                       count_indices(s, "transformer_blocks."), count_indices(s, "single_transformer_blocks."),
                       s["context_embedder.weight"][1], s["transformer_blocks.0.ff.linear_out.weight"][1],
                       s["time_guidance_embed.timestep_embedder.linear_1.weight"][1],
                       "time_guidance_embed.guidance_embedder.linear_1.weight" in s)


def _bfl_dit_config(s: Shapes) -> dict[str, Any]:
    inner, in_channels = s["img_in.weight"]
    return _dit_config(inner, in_channels, s["final_layer.linear.weight"][0],
                       s["double_blocks.0.img_attn.norm.query_norm.scale"][0], count_indices(s, "double_blocks."),
                       count_indices(s, "single_blocks."), s["txt_in.weight"][1],
                       s["double_blocks.0.img_mlp.2.weight"][1],
                       s["time_in.in_layer.weight"][1], "guidance_in.in_layer.weight" in s)


def dit_width(s: Shapes) -> int | None:
    """The DiT's hidden width from any of its weights, diffusers or BFL names (one shard of several suffices)."""
    for key, shape in s.items():
        if key.endswith(("attn.to_out.0.weight", "img_attn.proj.weight", "attn.to_out.weight", "linear2.weight",
                         "x_embedder.weight", "img_in.weight")):
            return shape[0]
    return None


# --- telling the variants apart --------------------------------------------------------------------

# The released DiT widths tell the size: FLUX.2-dev 6144, klein 4B 3072, klein 9B 4096.
SIZE_OF_WIDTH = {6144: "dev", 3072: "4b", 4096: "9b"}
_DEV = re.compile(r"flux[._ -]?2[._ -]?dev", re.IGNORECASE)
_KLEIN = re.compile(r"klein[._ -]?(base[._ -]?)?(4|9)b", re.IGNORECASE)


def _klein(base: bool, size: str) -> str:
    return f"klein-{'base-' if base else ''}{size}"


def _from_names(path: Path) -> str | None:
    """A release's name among the path's parts (``black-forest-labs/FLUX.2-klein-base-4B``,
    ``flux-2-klein-4b.safetensors``)."""
    for part in reversed(Path(path).parts):
        if _DEV.search(part):
            return "dev"
        match = _KLEIN.search(part)
        if match:
            return _klein(bool(match.group(1)), match.group(2) + "b")
    return None


def _from_folder(path: Path) -> str | None:
    """A diffusers folder: its pipeline class, ``is_distilled`` and the transformer's width."""
    index = read_model_index_file(path)
    if index.get("_class_name") == "Flux2Pipeline":
        return "dev"
    config = path / "transformer" / "config.json"
    if not config.is_file():
        return None
    dit = json.loads(config.read_text())
    size = SIZE_OF_WIDTH.get(dit.get("num_attention_heads", 0) * dit.get("attention_head_dim", 0))
    return _klein(not index.get("is_distilled", False), size) if size in ("4b", "9b") else None


def variant_of(path: Path | None) -> str | None:
    """The variant a model folder, transformer folder or DiT file is: from a diffusers folder's
    model_index.json, else the release's name in the path, else FLUX.2-dev's width in the weights (klein's
    base and distilled releases share every shape); None where nothing tells."""
    if path is None:
        return None
    path = Path(path)
    if (path / "model_index.json").is_file():
        return _from_folder(path)
    named = _from_names(path)
    if named is not None or not path.exists():
        return named
    files = sorted(path.rglob("*.safetensors")) if path.is_dir() else [path]
    if not files or files[0].suffix != ".safetensors":
        return None
    return "dev" if SIZE_OF_WIDTH.get(dit_width(read_shapes(files[:1])) or 0) == "dev" else None


def encoders_variant(sources: Mapping[str, list[str]]) -> str | None:
    """The variant the encoders' files alone tell (stage 1 of a split run names no DiT): only FLUX.2-dev
    encodes with Mistral; klein's Qwen3 serves the base and the distilled release alike."""
    files = [Path(p) for p in sources.get("text_encoder", []) if str(p).endswith(".safetensors")]
    if files and any(k.startswith(("vision_tower.", "model.vision_tower.", "language_model.model."))
                     for k in read_shapes(files)):
        return "dev"
    return None


# --- text encoders ------------------------------------------------------------------------------------

# Mistral3 checkpoints name the text decoder ``language_model.model.`` (as released) or
# ``model.language_model.`` (transformers >= 4.52); a bare MistralModel has no prefix.
_MISTRAL_PREFIXES = ("language_model.model.", "model.language_model.")


def mistral_text_name(key: str) -> str | None:
    """Checkpoint key of Mistral3 -> ``MistralModel`` name; None for the vision tower, projector and LM head."""
    for prefix in _MISTRAL_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return None


def _is_mistral3(s: Shapes) -> bool:
    return any(mistral_text_name(k) == "embed_tokens.weight" for k in s) and any(
        k.startswith(("vision_tower.", "model.vision_tower.")) for k in s)


def _text_shapes(s: Shapes) -> Shapes:
    return {name: v for k, v in s.items() if (name := mistral_text_name(k)) is not None}


MISTRAL_HEAD_DIM = 128  # Mistral-Small-3.2's head size: not in the weights (no q/k norm), a fact of the release


def mistral_config(s: Shapes) -> dict[str, Any]:
    """Mistral-Small-3.2's text config (FLUX.2-dev text_encoder/config.json; DiffSynth's flux2_text_encoder.py),
    sizes from the weights."""
    s = _text_shapes(s)
    vocab, hidden = s["embed_tokens.weight"]
    return dict(model_type="mistral", architectures=["MistralModel"], vocab_size=vocab, hidden_size=hidden,
                intermediate_size=s["layers.0.mlp.gate_proj.weight"][0], num_hidden_layers=count_indices(s, "layers."),
                num_attention_heads=s["layers.0.self_attn.q_proj.weight"][0] // MISTRAL_HEAD_DIM,
                num_key_value_heads=s["layers.0.self_attn.k_proj.weight"][0] // MISTRAL_HEAD_DIM,
                head_dim=MISTRAL_HEAD_DIM, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=1e9,
                max_position_embeddings=131072, sliding_window=None, tie_word_embeddings=False)


def mistral_text_only(state: StateDict) -> StateDict:
    return {name: v for k, v in state.items() if (name := mistral_text_name(k)) is not None}


def _qwen3_format() -> ReleasedFormat:
    """klein's Qwen3-4B / Qwen3-8B: the format Z-Image's Qwen3-4B is read with, named for FLUX.2."""
    from dataclasses import replace

    from . import z_image_released

    qwen3 = next(f for f in z_image_released.FORMATS if f.component == "text_encoder")
    return replace(qwen3, description="FLUX.2-klein text_encoder weights (Qwen3)")


FORMATS = (
    ReleasedFormat("transformer", "diffusers", "Flux2Transformer2DModel", "FLUX.2 transformer weights",
                   lambda s: "double_stream_modulation_img.linear.weight" in s and "x_embedder.weight" in s,
                   _diffusers_dit_config),
    ReleasedFormat("transformer", "diffusers", "Flux2Transformer2DModel",
                   "BFL flux2-dev / flux-2-klein single files (original names)",
                   lambda s: "double_stream_modulation_img.lin.weight" in s and "img_in.weight" in s,
                   _bfl_dit_config, convert=bfl_to_diffusers),
    *flux2_vae_released.FORMATS,
    ReleasedFormat("text_encoder", "transformers", "MistralModel",
                   "FLUX.2-dev text_encoder weights (Mistral-Small-3.2; its text decoder is read)", _is_mistral3,
                   mistral_config, convert=mistral_text_only),
    _qwen3_format(),
)
