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
import re
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
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **_image_config(s, names))


def _image_config(s: Shapes, names: dict[str, str]) -> dict[str, Any]:
    """Wan2.1 I2V's DiT also cross-attends CLIP image tokens (an image embedder, ``k_img``/``v_img``); Wan2.2's
    I2V-A14B and TI2V-5B do not (DiffSynth-Studio configs/model_configs.py: ``has_image_input``)."""
    if names["image"] not in s:
        return {}
    return dict(image_dim=s[names["image"]][0], added_kv_proj_dim=s[names["k_img"]][1])


_NATIVE_NAMES = dict(head="head.head.weight", text="text_embedding.0.weight", time="time_embedding.0.weight",
                     ffn="blocks.0.ffn.0.weight", cross_norm="blocks.0.norm3.weight", image="img_emb.proj.0.weight",
                     k_img="blocks.0.cross_attn.k_img.weight")
_DIFFUSERS_NAMES = dict(head="proj_out.weight", text="condition_embedder.text_embedder.linear_1.weight",
                        time="condition_embedder.time_embedder.linear_1.weight", ffn="blocks.0.ffn.net.0.proj.weight",
                        cross_norm="blocks.0.norm2.weight", image="condition_embedder.image_embedder.norm1.weight",
                        k_img="blocks.0.attn2.add_k_proj.weight")


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


# --- the Wan2.2 VAE (TI2V-5B's Wan2.2_VAE.pth) ------------------------------------------------------------
# Wan's vae2_2.py (DiffSynth-Studio diffsynth/models/wan_video_vae.py, ``WanVideoVAE38``) nests each level's
# residual blocks and its resample in one Sequential: ``encoder.downsamples.I.downsamples.J`` (J < the
# blocks: a residual block; J = the blocks: the resample), ``decoder.upsamples.I.upsamples.J`` likewise.
# diffusers' AutoencoderKLWan(is_residual=True) keeps them as ``down_blocks.I.resnets.J`` and
# ``down_blocks.I.downsampler`` (the layout diffusers' scripts/convert_wan_to_diffusers.py convert_vae_22 writes).

_VAE22_LEVEL = re.compile(r"^(encoder|decoder)\.(down|up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\.(.+)$")
_VAE_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.": "conv1.", "residual.3.gamma": "norm2.gamma",
                 "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}
_VAE_FIXED = {"encoder.conv1.": "encoder.conv_in.", "decoder.conv1.": "decoder.conv_in.",
              "encoder.head.0.gamma": "encoder.norm_out.gamma", "encoder.head.2.": "encoder.conv_out.",
              "decoder.head.0.gamma": "decoder.norm_out.gamma", "decoder.head.2.": "decoder.conv_out.",
              "conv1.": "quant_conv.", "conv2.": "post_quant_conv."}
_VAE_MIDDLE = {"middle.0.": "mid_block.resnets.0.", "middle.1.": "mid_block.attentions.0.",
               "middle.2.": "mid_block.resnets.1."}


def _renamed(rest: str, table: dict[str, str]) -> str | None:
    return next((new + rest[len(old):] for old, new in table.items() if rest.startswith(old)), None)


def _vae22_key(key: str) -> str:
    """One Wan2.2 VAE key in diffusers' name."""
    fixed = _renamed(key, _VAE_FIXED)
    if fixed is not None:
        return fixed
    side, rest = key.split(".", 1)
    middle = _renamed(rest, _VAE_MIDDLE)
    if middle is not None:
        inner = middle.split(".", 3)  # mid_block, resnets|attentions, N, rest
        resnet = _renamed(inner[3], _VAE_RESIDUAL) if inner[1] == "resnets" else inner[3]
        return f"{side}.{'.'.join(inner[:3])}.{resnet}"
    match = _VAE22_LEVEL.match(key)
    if match is None:
        raise KeyError(f"not a Wan2.2 VAE key: {key!r}")
    side, kind, level, index, rest = match.groups()
    resnet = _renamed(rest, _VAE_RESIDUAL)
    if resnet is not None:
        return f"{side}.{kind}_blocks.{level}.resnets.{index}.{resnet}"
    return f"{side}.{kind}_blocks.{level}.{kind}sampler.{rest}"  # resample.1 / time_conv


def convert_vae22(state: StateDict) -> StateDict:
    return {_vae22_key(key): value for key, value in state.items()}


def _vae22_config(s: Shapes, names: dict[str, Any]) -> dict[str, Any]:
    """The Wan2.2 VAE's config from its shapes: widths and block counts; the rest is the release's (wan22.VAE22)."""
    from . import wan22

    in_channels = s[names["conv_in"]][1]
    return dict(wan22.VAE22, base_dim=s[names["conv_in"]][0], z_dim=s[names["post_quant"]][0],
                decoder_base_dim=s[names["decoder_in"]][0] // wan22.VAE22["dim_mult"][-1],
                num_res_blocks=count_indices(s, names["blocks"]) - names["not_residual"], in_channels=in_channels,
                out_channels=s[names["conv_out"]][0], patch_size=math.isqrt(in_channels // 3))


# Where each layout keeps what the config is read from; the first level's blocks count its residual blocks (Wan's
# names list the level's resample among them).
_VAE22_NATIVE = dict(conv_in="encoder.conv1.weight", post_quant="conv2.weight", decoder_in="decoder.conv1.weight",
                     conv_out="decoder.head.2.weight", blocks="encoder.downsamples.0.downsamples.", not_residual=1)
_VAE22_DIFFUSERS = dict(conv_in="encoder.conv_in.weight", post_quant="post_quant_conv.weight",
                        decoder_in="decoder.conv_in.weight", conv_out="decoder.conv_out.weight",
                        blocks="encoder.down_blocks.0.resnets.", not_residual=0)


def _is_diffusers_vae22(s: Shapes) -> bool:
    """diffusers' Wan2.2 VAE names; its causal convolutions are 3-D (Qwen-Image-2.1's VAE, named alike, has 2-D)."""
    return "encoder.down_blocks.0.resnets.0.conv1.weight" in s and "encoder.norm_out.gamma" in s \
        and len(s.get("encoder.conv_in.weight", ())) == 5


# --- Wan2.1 I2V's CLIP (models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth) -----------------------------
# open-clip's XLM-RoBERTa ViT-H/14 as Wan's clip.py (and DiffSynth's wan_video_image_encoder.py) names it; only
# its vision tower (``visual.*``) conditions the DiT, mapped onto transformers' CLIPVisionModel: the same
# pre-norm ViT (exact GELU, a class token, LayerNorm eps 1e-5), q/k/v fused in ``to_qkv``.
CLIP_HEAD_DIM = 80  # ViT-H/14: 1280 wide, 16 heads
_CLIP_LAYER = {"norm1.": "layer_norm1.", "norm2.": "layer_norm2.", "attn.proj.": "self_attn.out_proj.",
               "mlp.0.": "mlp.fc1.", "mlp.2.": "mlp.fc2."}
_CLIP_ROOT = {"visual.patch_embedding.weight": "embeddings.patch_embedding.weight",
              "visual.pre_norm.weight": "pre_layrnorm.weight", "visual.pre_norm.bias": "pre_layrnorm.bias",
              "visual.post_norm.weight": "post_layernorm.weight", "visual.post_norm.bias": "post_layernorm.bias"}


def _clip_layer(index: str, rest: str, value: Any) -> StateDict:
    prefix = f"encoder.layers.{index}."
    if rest.startswith("attn.to_qkv."):
        param = rest.rsplit(".", 1)[1]
        return {f"{prefix}self_attn.{name}_proj.{param}": part
                for name, part in zip("qkv", value.chunk(3, dim=0))}
    return {prefix + _renamed(rest, _CLIP_LAYER): value}


def convert_open_clip_visual(state: StateDict) -> StateDict:
    """The vision tower in CLIPVisionModel's names; the text tower, the logit scale and the projection dropped."""
    out: StateDict = {}
    for key, value in state.items():
        if key in _CLIP_ROOT:
            out[_CLIP_ROOT[key]] = value
        elif key == "visual.cls_embedding":
            out["embeddings.class_embedding"] = value.reshape(-1)
        elif key == "visual.pos_embedding":
            out["embeddings.position_embedding.weight"] = value.reshape(value.shape[-2:])
        elif key.startswith("visual.transformer."):
            index, rest = key[len("visual.transformer."):].split(".", 1)
            out.update(_clip_layer(index, rest, value))
    return out


def _clip_config(s: Shapes) -> dict[str, Any]:
    width, _, patch, _ = s["visual.patch_embedding.weight"]
    if width % CLIP_HEAD_DIM:
        raise ValueError(f"width {width} is not a multiple of the ViT-H head size {CLIP_HEAD_DIM}")
    tokens = s["visual.pos_embedding"][-2]
    return dict(hidden_size=width, intermediate_size=s["visual.transformer.0.mlp.0.weight"][0],
                num_hidden_layers=count_indices(s, "visual.transformer."), num_attention_heads=width // CLIP_HEAD_DIM,
                image_size=math.isqrt(tokens - 1) * patch, patch_size=patch, hidden_act="gelu", layer_norm_eps=1e-5,
                projection_dim=s["visual.head"][-1] if "visual.head" in s else width)


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
    ReleasedFormat("vae", "diffusers", "AutoencoderKLWan", "Wan2.2 Wan2.2_VAE.pth (Wan's names)",
                   lambda s: "encoder.downsamples.0.downsamples.0.residual.0.gamma" in s,
                   lambda s: _vae22_config(s, _VAE22_NATIVE), convert=convert_vae22),
    ReleasedFormat("vae", "diffusers", "AutoencoderKLWan", "diffusers Wan2.2 vae weights", _is_diffusers_vae22,
                   lambda s: _vae22_config(s, _VAE22_DIFFUSERS)),
    ReleasedFormat("image_encoder", "transformers", "CLIPVisionModel", "Wan2.1 I2V "
                   "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth (open-clip's names)",
                   lambda s: "visual.transformer.0.attn.to_qkv.weight" in s and "visual.cls_embedding" in s,
                   _clip_config, convert=convert_open_clip_visual),
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
