"""FLUX.1 as released by Black Forest Labs (and as DiffSynth-Studio downloads it).

* ``flux1-dev.safetensors``: the DiT with BFL's names (``double_blocks.N.img_attn.qkv`` ...).  The
  mapping below follows diffusers' ``convert_flux_transformer_checkpoint_to_diffusers``
  (diffusers/loaders/single_file_utils.py), which hard-codes FLUX.1's width (3072) when it splits
  a single block's ``linear1``; this table takes the width from the weights, so it serves any
  width and also runs backwards (diffusers -> BFL, for test fixtures).
* ``ae.safetensors``: the VAE with ldm names, converted by diffusers' ``convert_ldm_vae_checkpoint``.
* ``text_encoder/`` (CLIP-L) and ``text_encoder_2/`` (T5-XXL) in transformers' layout; DiffSynth's
  patterns download their weights without ``config.json``, so the configs are derived from the
  shapes plus the released models' fixed facts (openai/clip-vit-large-patch14's text config;
  DiffSynth's flux_text_encoder_t5.py for T5 v1.1 XXL).
"""

from __future__ import annotations

from typing import Any

import torch

from .released import ReleasedFormat, count_indices, rope_axes, t5_encoder_config
from .weight_files import Shapes, StateDict

# --- the DiT: BFL names <-> diffusers names ------------------------------------------------------

_ROOT = {  # diffusers module -> BFL module (weight and bias)
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
}
_DOUBLE = {  # under transformer_blocks.N. / double_blocks.N.
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
}
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_DOUBLE_NORMS = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale",
                 "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
                 "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
                 "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale"}
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # BFL linear1: q, k, v, then the MLP
_SINGLE_NORMS = {"attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}
_NORM_OUT = ("norm_out.linear", "final_layer.adaLN_modulation.1")  # BFL stores (shift, scale), diffusers (scale, shift)


def _pairs(num_layers: int, num_single: int, guidance: bool) -> tuple[dict[str, str], list[tuple[str, tuple[str, ...]]]]:
    """``(renames, fused)``: diffusers param -> BFL param, and BFL param -> diffusers params it splits into."""
    renames: dict[str, str] = {}
    fused: list[tuple[str, tuple[str, ...]]] = []

    def module(diffusers: str, bfl: str) -> None:
        for suffix in (".weight", ".bias"):
            renames[diffusers + suffix] = bfl + suffix

    for diffusers, bfl in _ROOT.items():
        if guidance or "guidance" not in diffusers:
            module(diffusers, bfl)
    for i in range(num_layers):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for diffusers, bfl in _DOUBLE.items():
            module(d + diffusers, b + bfl)
        renames.update({d + k: b + v for k, v in _DOUBLE_NORMS.items()})
        for bfl, parts in _DOUBLE_FUSED.items():
            fused += [(b + bfl + s, tuple(d + p + s for p in parts)) for s in (".weight", ".bias")]
    for i in range(num_single):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for diffusers, bfl in _SINGLE.items():
            module(d + diffusers, b + bfl)
        renames.update({d + k: b + v for k, v in _SINGLE_NORMS.items()})
        fused += [(b + "linear1" + s, tuple(d + p + s for p in _SINGLE_FUSED)) for s in (".weight", ".bias")]
    return renames, fused


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def bfl_to_diffusers(state: StateDict) -> StateDict:
    """BFL FLUX DiT names -> ``FluxTransformer2DModel`` names; every key must be used."""
    state = dict(state)
    inner = state["img_in.weight"].shape[0]
    renames, fused = _pairs(count_indices(state, "double_blocks."), count_indices(state, "single_blocks."),
                            "guidance_in.in_layer.weight" in state)
    out = {diffusers: state.pop(bfl) for diffusers, bfl in renames.items()}
    for bfl, parts in fused:
        tensor = state.pop(bfl)
        sizes = [tensor.shape[0] // 3] * 3 if len(parts) == 3 else [inner] * 3 + [tensor.shape[0] - 3 * inner]
        out.update(zip(parts, torch.split(tensor, sizes, dim=0)))
    for suffix in (".weight", ".bias"):
        out[_NORM_OUT[0] + suffix] = _swap_halves(state.pop(_NORM_OUT[1] + suffix))
    if state:
        raise KeyError(f"unexpected BFL keys {sorted(state)[:3]}")
    return out


def diffusers_to_bfl(state: StateDict) -> StateDict:
    """The inverse of :func:`bfl_to_diffusers` (how BFL released the weights; used by test fixtures)."""
    state = dict(state)
    renames, fused = _pairs(count_indices(state, "transformer_blocks."),
                            count_indices(state, "single_transformer_blocks."),
                            "time_text_embed.guidance_embedder.linear_1.weight" in state)
    out = {bfl: state.pop(diffusers) for diffusers, bfl in renames.items()}
    for bfl, parts in fused:
        out[bfl] = torch.cat([state.pop(p) for p in parts], dim=0)
    for suffix in (".weight", ".bias"):
        out[_NORM_OUT[1] + suffix] = _swap_halves(state.pop(_NORM_OUT[0] + suffix))
    if state:
        raise KeyError(f"unexpected diffusers keys {sorted(state)[:3]}")
    return out


def _transformer_config(inner: int, in_channels: int, out_channels: int, head_dim: int, layers: int, single: int,
                        joint: int, pooled: int, guidance: bool) -> dict[str, Any]:
    return dict(patch_size=1, in_channels=in_channels, num_layers=layers,
                out_channels=None if out_channels == in_channels else out_channels,  # as FLUX.1's config says
                num_single_layers=single, attention_head_dim=head_dim, num_attention_heads=inner // head_dim,
                joint_attention_dim=joint, pooled_projection_dim=pooled, guidance_embeds=guidance,
                axes_dims_rope=rope_axes(head_dim))


def _bfl_transformer_config(s: Shapes) -> dict[str, Any]:
    inner, in_channels = s["img_in.weight"]
    return _transformer_config(inner, in_channels, s["final_layer.linear.weight"][0],
                               s["double_blocks.0.img_attn.norm.query_norm.scale"][0],
                               count_indices(s, "double_blocks."), count_indices(s, "single_blocks."),
                               s["txt_in.weight"][1], s["vector_in.in_layer.weight"][1], "guidance_in.in_layer.weight" in s)


def _diffusers_transformer_config(s: Shapes) -> dict[str, Any]:
    inner, in_channels = s["x_embedder.weight"]
    return _transformer_config(inner, in_channels, s["proj_out.weight"][0], s["transformer_blocks.0.attn.norm_q.weight"][0],
                               count_indices(s, "transformer_blocks."), count_indices(s, "single_transformer_blocks."),
                               s["context_embedder.weight"][1], s["time_text_embed.text_embedder.linear_1.weight"][1],
                               "time_text_embed.guidance_embedder.linear_1.weight" in s)


# --- the VAE (ae.safetensors: ldm names) -------------------------------------------------------------

# FLUX.1's VAE facts (black-forest-labs/FLUX.1-dev vae/config.json): these are not in the weights.
_VAE_FACTS = dict(norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159, sample_size=1024, act_fn="silu")


# Where each VAE size is found, in ldm names and in diffusers names.
_LDM_NAMES = dict(down="encoder.down.", block="encoder.down.{}.block.0.conv1.weight", blocks="encoder.down.0.block.",
                  attention="encoder.mid.attn_1.q.weight")
_DIFFUSERS_NAMES = dict(down="encoder.down_blocks.", block="encoder.down_blocks.{}.resnets.0.conv1.weight",
                        blocks="encoder.down_blocks.0.resnets.", attention="encoder.mid_block.attentions.0.to_q.weight")


def _vae_config(s: Shapes, names: dict[str, str]) -> dict[str, Any]:
    levels = count_indices(s, names["down"])
    return dict(_VAE_FACTS, in_channels=s["encoder.conv_in.weight"][1], out_channels=s["decoder.conv_out.weight"][0],
                down_block_types=["DownEncoderBlock2D"] * levels, up_block_types=["UpDecoderBlock2D"] * levels,
                block_out_channels=[s[names["block"].format(i)][0] for i in range(levels)],
                layers_per_block=count_indices(s, names["blocks"]),
                latent_channels=s["encoder.conv_out.weight"][0] // 2, use_quant_conv="quant_conv.weight" in s,
                use_post_quant_conv="post_quant_conv.weight" in s, mid_block_add_attention=names["attention"] in s)


def _ldm_vae_config(s: Shapes) -> dict[str, Any]:
    return _vae_config(s, _LDM_NAMES)


def _convert_ldm_vae(state: StateDict) -> StateDict:
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    shapes = {k: tuple(v.shape) for k, v in state.items()}
    return convert_ldm_vae_checkpoint(dict(state), _ldm_vae_config(shapes))


def _diffusers_vae_config(s: Shapes) -> dict[str, Any]:
    return _vae_config(s, _DIFFUSERS_NAMES)


# --- text encoders ---------------------------------------------------------------------------------

def _clip_prefix(s: Shapes) -> str:
    return "text_model." if "text_model.embeddings.token_embedding.weight" in s else ""


def _clip_config(s: Shapes) -> dict[str, Any]:
    """openai/clip-vit-large-patch14's text config (FLUX.1 text_encoder/config.json), sizes from the weights."""
    p = _clip_prefix(s)
    vocab, hidden = s[p + "embeddings.token_embedding.weight"]
    return dict(model_type="clip_text_model", architectures=["CLIPTextModel"], vocab_size=vocab, hidden_size=hidden,
                intermediate_size=s[p + "encoder.layers.0.mlp.fc1.weight"][0],
                num_hidden_layers=count_indices(s, p + "encoder.layers."), num_attention_heads=hidden // 64,
                max_position_embeddings=s[p + "embeddings.position_embedding.weight"][0], hidden_act="quick_gelu",
                layer_norm_eps=1e-5, projection_dim=768, bos_token_id=0, eos_token_id=2, pad_token_id=1)


def _is_clip(s: Shapes) -> bool:
    p = _clip_prefix(s)
    return p + "embeddings.token_embedding.weight" in s and p + "encoder.layers.0.self_attn.q_proj.weight" in s


def _is_t5(s: Shapes) -> bool:  # T5 v1.1: relative attention bias in the first block only (UMT5: every block)
    return ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in s
            and "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in s)


def _is_diffusers_vae(s: Shapes) -> bool:
    return "encoder.down_blocks.0.resnets.0.conv1.weight" in s and s.get("encoder.conv_out.weight", (0,))[0] == 32


FORMATS = (
    ReleasedFormat("transformer", "diffusers", "FluxTransformer2DModel", "BFL flux1-dev/schnell.safetensors",
                   lambda s: "double_blocks.0.img_attn.qkv.weight" in s and "img_in.weight" in s,
                   _bfl_transformer_config, convert=bfl_to_diffusers),
    ReleasedFormat("transformer", "diffusers", "FluxTransformer2DModel", "diffusers FLUX transformer weights",
                   lambda s: "single_transformer_blocks.0.proj_mlp.weight" in s and "x_embedder.weight" in s,
                   _diffusers_transformer_config),
    ReleasedFormat("vae", "diffusers", "AutoencoderKL", "BFL ae.safetensors (ldm VAE names, 16 latent channels)",
                   lambda s: "encoder.down.0.block.0.conv1.weight" in s and s.get("encoder.conv_out.weight", (0,))[0] == 32,
                   _ldm_vae_config, convert=_convert_ldm_vae),
    ReleasedFormat("vae", "diffusers", "AutoencoderKL", "diffusers FLUX vae weights", _is_diffusers_vae,
                   _diffusers_vae_config),
    ReleasedFormat("text_encoder", "transformers", "CLIPTextModel", "CLIP-L text_encoder weights", _is_clip,
                   _clip_config),
    ReleasedFormat("text_encoder_2", "transformers", "T5EncoderModel", "T5-XXL text_encoder_2 weights", _is_t5,
                   lambda s: t5_encoder_config(s, "t5")),
)

# DiffSynth-Studio's FLUX DiT module names (diffsynth/models/flux_dit.py) -> diffusers target patterns.
# DiffSynth fuses q, k, v (and a single block's MLP input) into one Linear; diffusers keeps them
# apart, so one fused target becomes three (or four) LoRAs of the same rank.
DIFFSYNTH_LORA_NAMES = {
    "a_to_qkv": ("transformer_blocks.*.attn.to_q", "transformer_blocks.*.attn.to_k", "transformer_blocks.*.attn.to_v"),
    "b_to_qkv": ("transformer_blocks.*.attn.add_q_proj", "transformer_blocks.*.attn.add_k_proj",
                 "transformer_blocks.*.attn.add_v_proj"),
    "a_to_out": ("transformer_blocks.*.attn.to_out.0",),
    "b_to_out": ("transformer_blocks.*.attn.to_add_out",),
    "ff_a.0": ("transformer_blocks.*.ff.net.0.proj",),
    "ff_a.2": ("transformer_blocks.*.ff.net.2",),
    "ff_b.0": ("transformer_blocks.*.ff_context.net.0.proj",),
    "ff_b.2": ("transformer_blocks.*.ff_context.net.2",),
    "norm1_a.linear": ("transformer_blocks.*.norm1.linear",),
    "norm1_b.linear": ("transformer_blocks.*.norm1_context.linear",),
    "norm.linear": ("single_transformer_blocks.*.norm.linear",),
    "to_qkv_mlp": ("single_transformer_blocks.*.attn.to_q", "single_transformer_blocks.*.attn.to_k",
                   "single_transformer_blocks.*.attn.to_v", "single_transformer_blocks.*.proj_mlp"),
    "proj_out": ("single_transformer_blocks.*.proj_out",),  # DiffSynth's final layer is final_proj_out
}
