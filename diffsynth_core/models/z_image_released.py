"""Z-Image as released: diffusers subfolders (also as DiffSynth-Studio downloads them) and ComfyUI's files.

* ``Tongyi-MAI/Z-Image-Turbo`` (and ``Tongyi-MAI/Z-Image``): ``transformer/``, ``text_encoder/`` (Qwen3-4B)
  and ``vae/`` in the diffusers/transformers layout; DiffSynth's patterns
  (``Tongyi-MAI/Z-Image-Turbo:transformer/*.safetensors`` ...) fetch their weights without ``config.json``,
  so the configs are derived from the shapes plus the release's fixed facts (its config.json files).
* ComfyUI's single files (Comfy-Org/z_image_turbo ``split_files``): the DiT under Z-Image's original
  names (``layers.N.attention.qkv`` fused, ``attention.out``, ``q_norm``/``k_norm``, ``x_embedder``,
  ``final_layer``), converted by diffusers' ``convert_z_image_transformer_checkpoint_to_diffusers``;
  ``qwen_3_4b.safetensors`` (Qwen3 with transformers' names); ``ae.safetensors`` (FLUX.1's VAE, ldm names).
"""

from __future__ import annotations

from typing import Any

import torch

from . import flux_released
from .released import ReleasedFormat, count_indices
from .weight_files import Shapes, StateDict

# The release's facts that are not in the weights' shapes (Tongyi-MAI/Z-Image-Turbo transformer/config.json).
_DIT_FACTS = dict(all_patch_size=[2], all_f_patch_size=[1], norm_eps=1e-5, qk_norm=True, rope_theta=256.0,
                  t_scale=1000.0, axes_lens=[1536, 512, 512])
PATCH_INPUTS = 2 * 2 * 1  # a latent patch: 2x2 pixels of one frame


def _dit_config(dim: int, patch_in: int, layers: int, refiners: int, head_dim: int, kv_dim: int, cap: int,
                siglip: int | None) -> dict[str, Any]:
    # RoPE split (frame, height, width): (32, 48, 48) at head_dim 128, the same proportions at other widths.
    axes = [head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8]
    return dict(_DIT_FACTS, in_channels=patch_in // PATCH_INPUTS, dim=dim, n_layers=layers, n_refiner_layers=refiners,
                n_heads=dim // head_dim, n_kv_heads=kv_dim // head_dim, cap_feat_dim=cap, siglip_feat_dim=siglip,
                axes_dims=axes)


def _diffusers_dit_config(s: Shapes) -> dict[str, Any]:
    dim, patch_in = s["all_x_embedder.2-1.weight"]
    siglip = s["siglip_embedder.1.weight"][1] if "siglip_embedder.1.weight" in s else None
    return _dit_config(dim, patch_in, count_indices(s, "layers."), count_indices(s, "noise_refiner."),
                       s["layers.0.attention.norm_q.weight"][0], s["layers.0.attention.to_k.weight"][0],
                       s["cap_embedder.1.weight"][1], siglip)


def _native_dit_config(s: Shapes) -> dict[str, Any]:
    dim, patch_in = s["x_embedder.weight"]
    return _dit_config(dim, patch_in, count_indices(s, "layers."), count_indices(s, "noise_refiner."),
                       s["layers.0.attention.q_norm.weight"][0], s["layers.0.attention.qkv.weight"][0] // 3,
                       s["cap_embedder.1.weight"][1], None)


def native_to_diffusers(state: StateDict) -> StateDict:
    """Z-Image's original DiT names (ComfyUI's file) -> ``ZImageTransformer2DModel`` names, with diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers(dict(state))


# diffusers name part -> original name part (the inverse of the converter's renames; test fixtures).
_TO_NATIVE = {"all_final_layer.2-1.": "final_layer.", "all_x_embedder.2-1.": "x_embedder.",
              ".attention.to_out.0.": ".attention.out.", ".attention.norm_q.": ".attention.q_norm.",
              ".attention.norm_k.": ".attention.k_norm."}


def diffusers_to_native(state: StateDict) -> StateDict:
    """``ZImageTransformer2DModel`` names -> the original names, q/k/v fused (how ComfyUI ships the DiT)."""
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [state[key.replace(".to_q.", f".to_{p}.")] for p in "qkv"]
            out[key.replace(".to_q.", ".qkv.")] = torch.cat(parts)
            continue
        for diffusers, native in _TO_NATIVE.items():
            key = key.replace(diffusers, native)
        out[key] = value
    return out


# --- the text encoder: Qwen3 (Qwen3ForCausalLM checkpoints say model.layers..., Qwen3Model ones layers...) ---

def _text_keys(s: Shapes) -> Shapes:
    return {k.removeprefix("model."): v for k, v in s.items()}


def _is_qwen3(s: Shapes) -> bool:  # Qwen3 normalises q and k per head; Qwen2.5(-VL) does not
    s = _text_keys(s)
    return "layers.0.self_attn.q_norm.weight" in s and "embed_tokens.weight" in s and not any(
        k.startswith(("visual.", "vision_tower.")) for k in s)


def _qwen3_config(s: Shapes) -> dict[str, Any]:
    """Qwen3-4B's config (Tongyi-MAI/Z-Image-Turbo text_encoder/config.json), sizes from the weights."""
    s = _text_keys(s)
    vocab, hidden = s["embed_tokens.weight"]
    head_dim = s["layers.0.self_attn.q_norm.weight"][0]
    return dict(model_type="qwen3", architectures=["Qwen3Model"], vocab_size=vocab, hidden_size=hidden,
                intermediate_size=s["layers.0.mlp.gate_proj.weight"][0],
                num_hidden_layers=count_indices(s, "layers."), head_dim=head_dim,
                num_attention_heads=s["layers.0.self_attn.q_proj.weight"][0] // head_dim,
                num_key_value_heads=s["layers.0.self_attn.k_proj.weight"][0] // head_dim, hidden_act="silu",
                rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, attention_bias=False,
                tie_word_embeddings="lm_head.weight" not in s, bos_token_id=151643, eos_token_id=151645)


FORMATS = (
    ReleasedFormat("transformer", "diffusers", "ZImageTransformer2DModel", "Z-Image transformer weights",
                   lambda s: "all_x_embedder.2-1.weight" in s and "noise_refiner.0.attention.to_q.weight" in s,
                   _diffusers_dit_config),
    ReleasedFormat("transformer", "diffusers", "ZImageTransformer2DModel",
                   "Z-Image DiT with its original names (ComfyUI's z_image*.safetensors)",
                   lambda s: "layers.0.attention.qkv.weight" in s and "noise_refiner.0.adaLN_modulation.0.weight" in s
                   and "cap_embedder.1.weight" in s, _native_dit_config, convert=native_to_diffusers),
    ReleasedFormat("text_encoder", "transformers", "Qwen3Model", "Z-Image text_encoder weights (Qwen3)", _is_qwen3,
                   _qwen3_config),
    # Z-Image's VAE is FLUX.1's: the same two formats (ae.safetensors, diffusers vae/).
    *(fmt for fmt in flux_released.FORMATS if fmt.component == "vae"),
)
