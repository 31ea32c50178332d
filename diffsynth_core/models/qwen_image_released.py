"""Qwen-Image as released (diffusers subfolders), also as DiffSynth-Studio downloads it.

DiffSynth's patterns (``Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors`` ...)
fetch the weights of ``transformer/``, ``text_encoder/`` and ``vae/`` without their
``config.json``; the configs are then derived from the shapes plus the release's fixed facts
(the text encoder's are those DiffSynth's qwen_image_text_encoder.py hard-codes for Qwen2.5-VL-7B).
"""

from __future__ import annotations

import math
from typing import Any

from .released import ReleasedFormat, count_indices, rope_axes
from .wan_released import diffusers_wan_vae_config, is_diffusers_wan_vae
from .weight_files import Shapes

TEXT_HEAD_DIM = 128   # Qwen2.5-VL-7B: hidden 3584 / 28 heads
VISION_HEAD_DIM = 80  # its vision tower: hidden 1280 / 16 heads
# Token ids of Qwen2.5-VL's vocabulary (generation and image prompts only; text encoding never reads them).
_TOKEN_IDS = dict(bos_token_id=151643, eos_token_id=151645, image_token_id=151655, video_token_id=151656,
                  vision_start_token_id=151652, vision_end_token_id=151653)


def _transformer_config(s: Shapes) -> dict[str, Any]:
    inner, in_channels = s["img_in.weight"]
    head_dim = s["transformer_blocks.0.attn.norm_q.weight"][0]
    return dict(patch_size=2, in_channels=in_channels, out_channels=s["proj_out.weight"][0] // 4,
                num_layers=count_indices(s, "transformer_blocks."), attention_head_dim=head_dim,
                num_attention_heads=inner // head_dim, joint_attention_dim=s["txt_in.weight"][1],
                guidance_embeds=False, axes_dims_rope=rope_axes(head_dim))


def _text_keys(s: Shapes) -> Shapes:
    """Checkpoints from transformers < 4.52 say ``model.layers``/``visual``; later ones
    ``model.language_model.layers``/``model.visual``: one spelling for the config below."""
    return {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v for k, v in s.items()}


def _text_config(s: Shapes) -> dict[str, Any]:
    s = _text_keys(s)
    vocab, hidden = s["model.embed_tokens.weight"]
    layers = count_indices(s, "model.layers.")
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=s["model.layers.0.mlp.gate_proj.weight"][0],
                num_hidden_layers=layers, num_attention_heads=s["model.layers.0.self_attn.q_proj.weight"][0] // TEXT_HEAD_DIM,
                num_key_value_heads=s["model.layers.0.self_attn.k_proj.weight"][0] // TEXT_HEAD_DIM,
                hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000,
                max_window_layers=layers, sliding_window=32768, use_sliding_window=False,
                rope_scaling={"mrope_section": [TEXT_HEAD_DIM // 8, 3 * TEXT_HEAD_DIM // 16, 3 * TEXT_HEAD_DIM // 16],
                              "rope_type": "default", "type": "default"}, **_TOKEN_IDS)
    vision_hidden = s["visual.blocks.0.norm1.weight"][0]
    patch = s["visual.patch_embed.proj.weight"]  # (hidden, channels, temporal patch, patch, patch)
    vision = dict(depth=count_indices(s, "visual.blocks."), hidden_size=vision_hidden, hidden_act="silu",
                  intermediate_size=s["visual.blocks.0.mlp.gate_proj.weight"][0],
                  num_heads=vision_hidden // VISION_HEAD_DIM, in_chans=patch[1], temporal_patch_size=patch[2],
                  patch_size=patch[3], out_hidden_size=s["visual.merger.mlp.2.weight"][0],
                  spatial_merge_size=math.isqrt(s["visual.merger.mlp.0.weight"][1] // vision_hidden),
                  window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
    return dict(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], vocab_size=vocab,
                text_config=text, vision_config=vision, tie_word_embeddings="lm_head.weight" not in s, **_TOKEN_IDS)


def _is_text_encoder(s: Shapes) -> bool:
    s = _text_keys(s)
    # Qwen2.5-VL's merger is an MLP (Qwen3-VL's, Qwen-Image-2.1's encoder, has linear_fc layers)
    return "model.layers.0.self_attn.q_proj.weight" in s and "visual.merger.mlp.0.weight" in s


FORMATS = (
    ReleasedFormat("transformer", "diffusers", "QwenImageTransformer2DModel", "Qwen-Image transformer weights",
                   lambda s: "transformer_blocks.0.img_mod.1.weight" in s and "txt_in.weight" in s,
                   _transformer_config),
    ReleasedFormat("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration",
                   "Qwen-Image text_encoder weights (Qwen2.5-VL)", _is_text_encoder, _text_config),
    ReleasedFormat("vae", "diffusers", "AutoencoderKLQwenImage", "Qwen-Image vae weights", is_diffusers_wan_vae,
                   diffusers_wan_vae_config),
)
