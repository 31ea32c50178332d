"""Tiny Wan2.2 TI2V-5B, Wan2.2 I2V-A14B and Wan2.1 I2V-14B releases, written as released_layouts.py writes
the others: the diffusers layout (``root/reference``) and DiffSynth-Studio's (``root/models/<model_id>/``: Wan's
own file and key names, as its example scripts name them).

The tiny sizes keep the facts the loaders take from the releases: Wan's DiT head size of 128, the ViT-H
head size of 80 (``wan_released.CLIP_HEAD_DIM``), the Wan2.2 VAE's layout (``wan22.VAE22``).  The inverse
conversions (diffusers -> Wan's names) live here; tests/core/models/test_released.py checks each against the
forward converter.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffsynth_core.models import wan22, wan_released
from diffsynth_core.models.wan_released import umt5_to_native_t5

from .released_layouts import _save_shards, _weights, wan_transformer_names, wan_vae_names

# release -> its model id (the folder DiffSynth downloads it to)
MODEL_IDS = {"wan-ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B", "wan-i2v-a14b": "Wan-AI/Wan2.2-I2V-A14B",
             "wan-i2v-14b": "Wan-AI/Wan2.1-I2V-14B-480P"}
CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
_DIT = dict(patch_size=(1, 2, 2), num_attention_heads=1, attention_head_dim=128, out_channels=16, text_dim=32,
            freq_dim=256, ffn_dim=64, num_layers=2)


# --- inverse conversions ----------------------------------------------------------------------------

# the forward tables read backwards (the reference model's keys check both ways: test_released.py)
_RESIDUAL = {ours: theirs for theirs, ours in wan_released._VAE_RESIDUAL.items()}
_FIXED = {ours: theirs for theirs, ours in wan_released._VAE_FIXED.items()}


def _swap(rest: str, table: dict[str, str]) -> str:
    return next((new + rest[len(old):] for old, new in table.items() if rest.startswith(old)), rest)


def _resnets(state: dict, block: str) -> int:
    return len({k[len(block):].split(".", 1)[0] for k in state if k.startswith(block)})


def wan22_vae_names(state: dict) -> dict:
    """diffusers ``AutoencoderKLWan(is_residual=True)`` -> Wan's names (Wan2.2_VAE.pth): each level's residual
    blocks, then its resample, in one ``downsamples``/``upsamples`` Sequential (Wan's vae2_2.py)."""
    out = {}
    for key, value in state.items():
        if _swap(key, _FIXED) != key:
            out[_swap(key, _FIXED)] = value
            continue
        side, group, *rest = key.split(".")
        if group == "mid_block":
            index = {"resnets.0": "0", "attentions.0": "1", "resnets.1": "2"}[".".join(rest[:2])]
            inner = ".".join(rest[2:])
            out[f"{side}.middle.{index}.{_swap(inner, _RESIDUAL) if rest[0] == 'resnets' else inner}"] = value
            continue
        kind = group.split("_")[0]  # down | up
        level, part = rest[0], rest[1]
        if part == "resnets":
            native = f"{kind}samples.{rest[2]}.{_swap('.'.join(rest[3:]), _RESIDUAL)}"
        else:  # the level's resample, after its residual blocks
            native = f"{kind}samples.{_resnets(state, f'{side}.{group}.{level}.resnets.')}.{'.'.join(rest[2:])}"
        out[f"{side}.{kind}samples.{level}.{native}"] = value
    return out


def open_clip_visual_names(state: dict, projection: int = 16, seed: int = 0) -> dict:
    """transformers ``CLIPVisionModel`` -> open-clip's XLM-RoBERTa ViT-H names (Wan's CLIP .pth), with what the
    release holds besides the vision tower (its projection head, a text tower, the logit scale)."""
    out = {"visual.cls_embedding": state["embeddings.class_embedding"][None, None],
           "visual.pos_embedding": state["embeddings.position_embedding.weight"][None],
           "visual.patch_embedding.weight": state["embeddings.patch_embedding.weight"]}
    for ours, theirs in (("pre_layrnorm", "pre_norm"), ("post_layernorm", "post_norm")):
        out.update({f"visual.{theirs}.{p}": state[f"{ours}.{p}"] for p in ("weight", "bias")})
    layers = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj", "mlp.fc1": "mlp.0",
              "mlp.fc2": "mlp.2"}
    for i in range(_resnets(state, "encoder.layers.")):
        prefix = f"encoder.layers.{i}."
        for p in ("weight", "bias"):
            out.update({f"visual.transformer.{i}.{theirs}.{p}": state[f"{prefix}{ours}.{p}"]
                        for ours, theirs in layers.items()})
            out[f"visual.transformer.{i}.attn.to_qkv.{p}"] = torch.cat(
                [state[f"{prefix}self_attn.{x}_proj.{p}"] for x in "qkv"])
    g = torch.Generator().manual_seed(seed)
    width = state["embeddings.class_embedding"].shape[0]
    out.update({"visual.head": torch.randn(width, projection, generator=g), "log_scale": torch.tensor(4.6),
                "textual.token_embedding.weight": torch.randn(8, projection, generator=g)})
    return {k: v.contiguous() for k, v in out.items()}


# --- tiny models ----------------------------------------------------------------------------------

def _umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    from diffsynth_core.models import tiny_tokenizers

    tok = tiny_tokenizers.t5_tokenizer()
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                       layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1))
    return dict(text_encoder=text, tokenizer=tok)


def _scheduler(shift: float = 5.0):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=shift)


def _ti2v_5b():
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    dit = WanTransformer3DModel(**dict(_DIT, in_channels=48, out_channels=48))
    return WanPipeline(transformer=dit, vae=AutoencoderKLWan(**wan22.VAE22_TINY), scheduler=_scheduler(),
                       expand_timesteps=True, **_umt5())


def _wan21_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=16, num_res_blocks=2)


def _i2v_a14b():
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    high, low = (WanTransformer3DModel(**dict(_DIT, in_channels=36)) for _ in range(2))
    return WanImageToVideoPipeline(transformer=high, transformer_2=low, vae=_wan21_vae(), scheduler=_scheduler(),
                                   boundary_ratio=wan22.BOUNDARY_RATIO["i2v-a14b"], **_umt5())


def _i2v_14b():
    """Wan2.1 I2V: a CLIP ViT (one 80-wide head, 32 px in 8 px patches) whose tokens the DiT cross-attends."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=80, intermediate_size=37, num_hidden_layers=2,
                                            num_attention_heads=1, image_size=32, patch_size=8, hidden_act="gelu",
                                            layer_norm_eps=1e-5, projection_dim=16))
    dit = WanTransformer3DModel(**dict(_DIT, in_channels=36, image_dim=80, added_kv_proj_dim=128))
    return WanImageToVideoPipeline(transformer=dit, vae=_wan21_vae(), scheduler=_scheduler(3.0), image_encoder=clip,
                                   image_processor=CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32}),
                                   **_umt5())


_PIPELINES = {"wan-ti2v-5b": _ti2v_5b, "wan-i2v-a14b": _i2v_a14b, "wan-i2v-14b": _i2v_14b}


# --- DiffSynth's layout -----------------------------------------------------------------------------

def _save_dit(state: dict, folder: Path, shards: int = 1) -> None:
    """The DiT with Wan's names, one file or in shards as the 14B releases are (the input layer and the image
    embedder then lie in different shards)."""
    if shards > 1:
        _save_shards(wan_transformer_names(state), folder, "diffusion_pytorch_model", shards)
        return
    folder.mkdir(parents=True, exist_ok=True)
    save_file(wan_transformer_names(state), str(folder / "diffusion_pytorch_model.safetensors"))


def _write_layout(release: str, reference: Path, base: Path) -> None:
    base.mkdir(parents=True)
    torch.save(umt5_to_native_t5(_weights(reference / "text_encoder")), base / "models_t5_umt5-xxl-enc-bf16.pth")
    shutil.copytree(reference / "tokenizer", base / "google" / "umt5-xxl")
    vae = _weights(reference / "vae")
    if release == "wan-ti2v-5b":
        torch.save(wan22_vae_names(vae), base / "Wan2.2_VAE.pth")
        _save_dit(_weights(reference / "transformer"), base, shards=2)
        return
    torch.save(wan_vae_names(vae), base / "Wan2.1_VAE.pth")
    if release == "wan-i2v-a14b":
        _save_dit(_weights(reference / "transformer"), base / "high_noise_model")
        _save_dit(_weights(reference / "transformer_2"), base / "low_noise_model")
        return
    _save_dit(_weights(reference / "transformer"), base, shards=2)
    torch.save(open_clip_visual_names(_weights(reference / "image_encoder")), base / CLIP_FILE)


def build_wan_release(release: str, root: Path, seed: int = 0) -> Path:
    """``root/reference`` (diffusers layout) and ``root/models/<model_id>/`` (DiffSynth's); returns root."""
    from diffsynth_core.models.loading import MODEL_INIT_LOCK

    with MODEL_INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        pipe = _PIPELINES[release]()
    pipe.save_pretrained(root / "reference")
    _write_layout(release, root / "reference", root / "models" / MODEL_IDS[release])
    return root
