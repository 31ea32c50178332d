"""Qwen-Image-2.1 as released: diffusers subfolders (also as DiffSynth-Studio downloads them) and ComfyUI's DiT.

DiffSynth's patterns (``Qwen/Qwen-Image-2.1:transformer/diffusion_pytorch_model*.safetensors``,
``...:text_encoder/model*.safetensors``, ``...:vae/diffusion_pytorch_model*.safetensors``;
examples/qwen_image_21/model_training/lora/Qwen-Image-2.1.sh) fetch the weights without their
``config.json``: the configs are derived from the shapes plus the release's fixed facts below.  ComfyUI's
2.1 DiT (comfy/ldm/qwen_image21/model.py) keeps the diffusers names and fuses ``img_mlp.gate_layer`` and
``img_mlp.proj`` into ``img_mlp.gate_up`` ([gate; up]) at load; a file saved from it fused is split back.
"""

from __future__ import annotations

from typing import Any

import torch

from .released import ReleasedFormat, count_indices, rope_axes
from .weight_files import Shapes, StateDict

# Released layouts (benchmarks, and the facts configs are inferred with): Qwen3-VL-8B without its LM head
# (8.2 B parameters: text 4096 wide, 36 layers; vision tower 27 blocks with three deepstack mergers) and
# AutoencoderKLQwenImage21's defaults, which are the release's.
TEXT_FACTS = dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144, attention_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True})
VISION_FACTS = dict(hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[8, 16, 24], initializer_range=0.02)
ENCODER_CONFIGS = {
    "Qwen-Image-2.1": {
        "text": dict(TEXT_FACTS, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        "vision": dict(VISION_FACTS, depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                       out_hidden_size=4096, patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                       num_position_embeddings=2304, in_channels=3),
        "vae": {},
    },
}
# Qwen3-VL's token ids (generation and image prompts; the processor's tokenizer gives the same).
_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                  vision_end_token_id=151653)
VISION_HEAD_DIM = 72  # 1152 / 16 heads


# --- transformer ---------------------------------------------------------------------------------

def unfused(state: StateDict) -> StateDict:
    """ComfyUI's fused ``img_mlp.gate_up`` ([gate_layer; proj]) split into diffusers' two layers; else as is."""
    out = {}
    for key, value in state.items():
        if ".img_mlp.gate_up." in key:
            gate, up = value.chunk(2, dim=0)
            out[key.replace(".gate_up.", ".gate_layer.")], out[key.replace(".gate_up.", ".proj.")] = gate, up
        else:
            out[key] = value
    return out


def _transformer_config(s: Shapes) -> dict[str, Any]:
    inner, in_channels = s["img_in.weight"]
    head_dim = s["transformer_blocks.0.attn.norm_q.weight"][0]
    return dict(patch_size=1, in_channels=in_channels, out_channels=s["proj_out.weight"][0],
                num_layers=count_indices(s, "transformer_blocks."), attention_head_dim=head_dim,
                num_attention_heads=inner // head_dim, context_in_dim=s["txt_in.in_layer.weight"][1],
                mlp_ratio=s["transformer_blocks.0.img_mlp.out.weight"][1] // inner, axes_dims_rope=rope_axes(head_dim),
                causal_condition=True)


def _is_transformer(s: Shapes, mlp: str) -> bool:
    return ("txt_in.text_norm.weight" in s and "modulation.1.weight" in s
            and f"transformer_blocks.0.img_mlp.{mlp}.weight" in s)


# --- text encoder (Qwen3-VL) ---------------------------------------------------------------------

def _text_keys(s: Shapes) -> Shapes:
    """transformers < 4.52 saved ``model.layers``/``visual``; later ones ``model.language_model``/``model.visual``."""
    out = {}
    for key, value in s.items():
        if key.startswith("visual."):
            key = "model." + key
        elif key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
            key = "model.language_model." + key[len("model."):]
        out[key] = value
    return out


def _is_text_encoder(s: Shapes) -> bool:
    s = _text_keys(s)
    return "model.language_model.layers.0.self_attn.q_norm.weight" in s and "model.visual.merger.linear_fc1.weight" in s


def _text_config(s: Shapes) -> dict[str, Any]:
    s = _text_keys(s)
    text, vision = "model.language_model.", "model.visual."
    vocab, hidden = s[text + "embed_tokens.weight"]
    head_dim = s[text + "layers.0.self_attn.q_norm.weight"][0]
    patch = s[vision + "patch_embed.proj.weight"]  # (hidden, channels, temporal patch, patch, patch)
    vision_hidden = patch[0]
    mergers, released = count_indices(s, vision + "deepstack_merger_list."), VISION_FACTS["deepstack_visual_indexes"]
    if mergers != len(released):  # which vision blocks feed them is a fact of the release, not in the shapes
        raise ValueError(f"{mergers} deepstack mergers, the release has {len(released)}")
    text_config = dict(TEXT_FACTS, vocab_size=vocab, hidden_size=hidden, head_dim=head_dim,
                       intermediate_size=s[text + "layers.0.mlp.gate_proj.weight"][0],
                       num_hidden_layers=count_indices(s, text + "layers."),
                       num_attention_heads=s[text + "layers.0.self_attn.q_proj.weight"][0] // head_dim,
                       num_key_value_heads=s[text + "layers.0.self_attn.k_proj.weight"][0] // head_dim)
    vision_config = dict(VISION_FACTS, depth=count_indices(s, vision + "blocks."), hidden_size=vision_hidden,
                         intermediate_size=s[vision + "blocks.0.mlp.linear_fc1.weight"][0],
                         num_heads=vision_hidden // VISION_HEAD_DIM, in_channels=patch[1], temporal_patch_size=patch[2],
                         patch_size=patch[3], out_hidden_size=s[vision + "merger.linear_fc2.weight"][0],
                         spatial_merge_size=round((s[vision + "merger.linear_fc1.weight"][1] / vision_hidden) ** 0.5),
                         num_position_embeddings=s[vision + "pos_embed.weight"][0])
    return dict(model_type="qwen3_vl", architectures=["Qwen3VLForConditionalGeneration"], text_config=text_config,
                vision_config=vision_config, tie_word_embeddings="lm_head.weight" not in s, **_TOKEN_IDS)


# --- VAE -----------------------------------------------------------------------------------------

def _is_vae(s: Shapes) -> bool:
    """AutoencoderKLQwenImage21's keys; its causal convolutions are 2-D (Wan's VAEs' are 3-D)."""
    return len(s.get("encoder.conv_in.weight", ())) == 4 and "encoder.down_blocks.0.resnets.0.conv1.weight" in s \
        and "post_quant_conv.weight" in s


def _vae_config(s: Shapes) -> dict[str, Any]:
    base, in_channels = s["encoder.conv_in.weight"][:2]
    blocks = count_indices(s, "encoder.down_blocks.")
    return dict(base_dim=base, decoder_base_dim=s["decoder.conv_out.weight"][1], z_dim=s["post_quant_conv.weight"][0],
                dim_mult=[s[f"encoder.down_blocks.{i}.resnets.0.conv2.weight"][0] // base for i in range(blocks)],
                num_res_blocks=count_indices(s, "encoder.down_blocks.0.resnets."),
                temperal_downsample=[f"encoder.down_blocks.{i}.downsampler.time_conv.weight" in s
                                     for i in range(blocks - 1)],
                in_channels=in_channels, out_channels=s["decoder.conv_out.weight"][0])


FORMATS = (
    ReleasedFormat("transformer", "diffusers", "QwenImage21Transformer2DModel", "Qwen-Image-2.1 transformer weights",
                   lambda s: _is_transformer(s, "gate_layer"), _transformer_config),
    ReleasedFormat("transformer", "diffusers", "QwenImage21Transformer2DModel",
                   "Qwen-Image-2.1 transformer weights (ComfyUI's fused gate_up)",
                   lambda s: _is_transformer(s, "gate_up"),
                   _transformer_config, convert=unfused),
    ReleasedFormat("text_encoder", "transformers", "Qwen3VLForConditionalGeneration",
                   "Qwen-Image-2.1 text_encoder weights (Qwen3-VL)", _is_text_encoder, _text_config),
    ReleasedFormat("vae", "diffusers", "AutoencoderKLQwenImage21", "Qwen-Image-2.1 vae weights", _is_vae, _vae_config),
)


def fused(state: StateDict) -> StateDict:
    """The inverse of ``unfused``: diffusers' two MLP input layers as ComfyUI's ``gate_up`` (tests, fixtures)."""
    out = dict(state)
    for key in [k for k in state if ".img_mlp.gate_layer." in k]:
        up = out.pop(key.replace(".gate_layer.", ".proj."))
        out[key.replace(".gate_layer.", ".gate_up.")] = torch.cat([out.pop(key), up])
    return out
