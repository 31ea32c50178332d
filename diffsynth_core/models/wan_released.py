"""Wan2.1 as released by Wan-AI (and as DiffSynth-Studio downloads it), plus the diffusers layout.

* ``diffusion_pytorch_model*.safetensors``: the DiT with Wan's names (``blocks.N.self_attn.q``),
  converted by diffusers' ``convert_wan_transformer_to_diffusers``.  Its ``config.json`` (Wan's own
  format) is not among the files DiffSynth downloads; the config comes from the shapes, with
  Wan's head size of 128 (every Wan2.1/2.2 release: 1.3B 1536/12, 14B 5120/40).
* ``models_t5_umt5-xxl-enc-bf16.pth``: UMT5-XXL's encoder with Wan's names (``blocks.N.attn.q``),
  mapped here onto transformers' ``UMT5EncoderModel`` (the module layout of Wan's t5.py, as
  DiffSynth's wan_video_text_encoder.py copies it: ``fc1(x) * gelu(gate(x))``, per-block
  relative position embeddings).
* ``Wan2.1_VAE.pth``: the VAE with Wan's names, converted by diffusers' ``convert_wan_vae_to_diffusers``
  (which fixes the released layout: 2 residual blocks per level, channel multipliers 1,2,4,4).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .released import ReleasedFormat, count_indices, t5_encoder_config
from .weight_files import Shapes, StateDict

HEAD_DIM = 128


# --- the DiT ---------------------------------------------------------------------------------------

def _transformer_config(s: Shapes, names: dict[str, str]) -> dict[str, Any]:
    dim, in_channels, *patch = s["patch_embedding.weight"]
    if dim % HEAD_DIM:
        raise ValueError(f"width {dim} is not a multiple of Wan's head size {HEAD_DIM}")
    return dict(patch_size=tuple(patch), num_attention_heads=dim // HEAD_DIM, attention_head_dim=HEAD_DIM,
                in_channels=in_channels, out_channels=s[names["head"]][0] // math.prod(patch),
                text_dim=s[names["text"]][1], freq_dim=s[names["time"]][1], ffn_dim=s[names["ffn"]][0],
                num_layers=count_indices(s, "blocks."), cross_attn_norm=names["cross_norm"] in s,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


_NATIVE_NAMES = dict(head="head.head.weight", text="text_embedding.0.weight", time="time_embedding.0.weight",
                     ffn="blocks.0.ffn.0.weight", cross_norm="blocks.0.norm3.weight")
_DIFFUSERS_NAMES = dict(head="proj_out.weight", text="condition_embedder.text_embedder.linear_1.weight",
                        time="condition_embedder.time_embedder.linear_1.weight", ffn="blocks.0.ffn.net.0.proj.weight",
                        cross_norm="blocks.0.norm2.weight")


def _convert_native_transformer(state: StateDict) -> StateDict:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(state))


# --- the text encoder: Wan's T5 names <-> transformers' UMT5 names --------------------------------

_T5_BLOCK = {  # Wan blocks.N.<key> -> UMT5 encoder.block.N.<value>
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight", "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight", "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",  # the GELU branch
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}


def native_t5_to_umt5(state: StateDict) -> StateDict:
    state, out = dict(state), {}
    embedding = state.pop("token_embedding.weight")
    out["shared.weight"] = out["encoder.embed_tokens.weight"] = embedding  # tied in UMT5EncoderModel
    out["encoder.final_layer_norm.weight"] = state.pop("norm.weight")
    for i in range(count_indices(state, "blocks.")):
        out.update({f"encoder.block.{i}.{hf}": state.pop(f"blocks.{i}.{wan}") for wan, hf in _T5_BLOCK.items()})
    if state:
        raise KeyError(f"unexpected Wan T5 keys {sorted(state)[:3]}")
    return out


def umt5_to_native_t5(state: StateDict) -> StateDict:
    """The inverse of :func:`native_t5_to_umt5` (how Wan released the encoder; used by test fixtures)."""
    out = {"token_embedding.weight": state["shared.weight"], "norm.weight": state["encoder.final_layer_norm.weight"]}
    for i in range(count_indices(state, "encoder.block.")):
        out.update({f"blocks.{i}.{wan}": state[f"encoder.block.{i}.{hf}"] for wan, hf in _T5_BLOCK.items()})
    return out


def _native_t5_config(s: Shapes) -> dict[str, Any]:
    return t5_encoder_config(_shapes_as_umt5(s), "umt5")


def _shapes_as_umt5(s: Shapes) -> Shapes:
    renamed = {"shared.weight": s["token_embedding.weight"]}
    for i in range(count_indices(s, "blocks.")):
        renamed.update({f"encoder.block.{i}.{hf}": s[f"blocks.{i}.{wan}"] for wan, hf in _T5_BLOCK.items()
                        if f"blocks.{i}.{wan}" in s})
    return renamed


# --- the VAE (Wan2.1's, also Qwen-Image's) ------------------------------------------------------------

def wan_vae_config(base_dim: int, z_dim: int) -> dict[str, Any]:
    """The Wan2.1 VAE layout (diffusers' converter and the releases fix the rest); the latents'
    mean/std stay the class defaults, which are Wan2.1's (and Qwen-Image's) released values."""
    return dict(base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                temperal_downsample=[False, True, True])


def is_diffusers_wan_vae(s: Shapes) -> bool:
    return "encoder.norm_out.gamma" in s and "encoder.down_blocks.0.conv1.weight" in s and "post_quant_conv.weight" in s


def diffusers_wan_vae_config(s: Shapes) -> dict[str, Any]:
    return wan_vae_config(s["encoder.conv_in.weight"][0], s["post_quant_conv.weight"][0])


def _convert_native_vae(state: StateDict) -> StateDict:
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    return convert_wan_vae_to_diffusers(dict(state))


FORMATS = (
    ReleasedFormat("transformer", "diffusers", "WanTransformer3DModel", "Wan2.1 diffusion_pytorch_model*.safetensors "
                   "(Wan's names)", lambda s: "blocks.0.self_attn.q.weight" in s and "head.head.weight" in s,
                   lambda s: _transformer_config(s, _NATIVE_NAMES), convert=_convert_native_transformer),
    ReleasedFormat("transformer", "diffusers", "WanTransformer3DModel", "diffusers Wan transformer weights",
                   lambda s: "blocks.0.attn1.to_q.weight" in s and "condition_embedder.time_proj.weight" in s,
                   lambda s: _transformer_config(s, _DIFFUSERS_NAMES)),
    ReleasedFormat("text_encoder", "transformers", "UMT5EncoderModel", "Wan2.1 models_t5_umt5-xxl-enc-bf16.pth",
                   lambda s: "token_embedding.weight" in s and "blocks.0.pos_embedding.embedding.weight" in s,
                   _native_t5_config, convert=native_t5_to_umt5),
    ReleasedFormat("text_encoder", "transformers", "UMT5EncoderModel", "UMT5 text_encoder weights",
                   lambda s: "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" in s,
                   lambda s: t5_encoder_config(s, "umt5")),
    ReleasedFormat("vae", "diffusers", "AutoencoderKLWan", "Wan2.1 Wan2.1_VAE.pth (Wan's names)",
                   lambda s: "encoder.downsamples.0.residual.0.gamma" in s and "decoder.upsamples.0.residual.0.gamma" in s,
                   lambda s: wan_vae_config(s["encoder.conv1.weight"][0], s["conv2.weight"][0]),
                   convert=_convert_native_vae),
    ReleasedFormat("vae", "diffusers", "AutoencoderKLWan", "diffusers Wan vae weights", is_diffusers_wan_vae,
                   diffusers_wan_vae_config),
)


def _diffsynth_lora_names() -> dict[str, tuple[str, ...]]:
    """Wan's own module names, which DiffSynth-Studio's Wan DiT keeps (``q``, ``self_attn.q``, ``ffn.0`` ...),
    -> diffusers target names (the inverse of ``wan.native_name`` inside a block)."""
    pieces = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "k_img": "add_k_proj", "v_img": "add_v_proj"}
    names: dict[str, tuple[str, ...]] = {"ffn.0": ("ffn.net.0.proj",), "ffn.2": ("ffn.net.2",)}
    for native, diffusers in pieces.items():
        names[native] = (diffusers,)
        names[f"self_attn.{native}"] = (f"attn1.{diffusers}",)
        names[f"cross_attn.{native}"] = (f"attn2.{diffusers}",)
    return names


DIFFSYNTH_LORA_NAMES = _diffsynth_lora_names()

# Wan2.2 A14B's second expert (``transformer_2``, the low-noise DiT) is stored as the first is; listed
# last, so files recognised without a component name stay ``transformer`` (DiffSynth's one-expert runs).
FORMATS = FORMATS + tuple(dataclasses.replace(fmt, component="transformer_2", description=fmt.description +
                                              " as Wan2.2's low-noise expert")
                          for fmt in FORMATS if fmt.component == "transformer")
