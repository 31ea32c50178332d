"""Tiny real-architecture models written twice: in the diffusers layout (the reference) and as
DiffSynth-Studio keeps released models under ``./models/<model_id>/`` (original file and key names,
no ``config.json`` where DiffSynth's download patterns leave it out).

The tiny configs keep the facts the loaders take from the releases (head sizes, RoPE split, VAE
norm groups and scale factors, T5/CLIP activation and ids), so that configs inferred from the
weights' shapes are the configs the reference folder was saved with.  The inverse conversions
(diffusers -> original names) live here; each is checked against the forward converter in
tests/core/models/test_released.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from diffsynth_core.models import tiny_tokenizers
from diffsynth_core.models.flux2_vae_released import ATTENTION_NAMES, ATTENTION_WEIGHT, RESNET_NAMES
from diffsynth_core.models.flux_released import diffusers_to_bfl
from diffsynth_core.models.loading import MODEL_INIT_LOCK
from diffsynth_core.models.released import count_indices
from diffsynth_core.models.wan import native_name
from diffsynth_core.models.wan_released import umt5_to_native_t5

MODEL_IDS = {"qwen_image": "Qwen/Qwen-Image", "flux": "black-forest-labs/FLUX.1-dev", "wan": "Wan-AI/Wan2.1-T2V-1.3B",
             "z_image": "Tongyi-MAI/Z-Image-Turbo", "flux2": "black-forest-labs/FLUX.2-dev"}
Z_IMAGE_BASE_ID = "Tongyi-MAI/Z-Image"  # DiffSynth's Z-Image.sh takes only the transformer from here
# FLUX.2's releases: the reference folder each is written from (tiny widths at the release's block counts, since
# DiffSynth's scripts name every single block; the names tell base from distilled), whole where DiffSynth's
# scripts take more than the transformer from them (FLUX.2-klein-base-9B.sh: klein-9B's text encoder, VAE and
# tokenizer).
FLUX2_REFERENCES = {"reference-dev": ("dev", (8, 48)), "reference": ("klein-base-4b", (5, 20)),
                    "reference-9b": ("klein-base-9b", (8, 24))}
FLUX2_RELEASES = {"black-forest-labs/FLUX.2-dev": ("reference-dev", "whole"),
                  "black-forest-labs/FLUX.2-klein-4B": ("reference", "whole"),
                  "black-forest-labs/FLUX.2-klein-base-4B": ("reference", "transformer"),
                  "black-forest-labs/FLUX.2-klein-9B": ("reference-9b", "whole"),
                  "black-forest-labs/FLUX.2-klein-base-9B": ("reference-9b", "transformer")}


# --- inverse conversions ----------------------------------------------------------------------------

def plain_config(config) -> dict:
    """A model config as comparable data: tuples as lists, private keys dropped."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items() if not k.startswith("_")}


def assert_configs_inferred(spec, model, *renamings) -> None:
    """The transformer's released format, recognised from its weight shapes under each naming (diffusers',
    then each of ``renamings``), infers exactly ``model``'s config."""
    from accelerate import init_empty_weights

    for state in (model.state_dict(), *(rename(model.state_dict()) for rename in renamings)):
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        fmt = next(f for f in spec.released_formats if f.component == "transformer" and f.recognise(shapes))
        with init_empty_weights():
            inferred = type(model).from_config(fmt.infer_config(shapes)).config
        assert plain_config(inferred) == plain_config(model.config)


def ldm_vae_names(state: dict) -> dict:
    """diffusers ``AutoencoderKL`` -> ldm names (BFL's ae.safetensors), inverse of diffusers' convert_ldm_vae_checkpoint."""
    levels = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.down_blocks."))
    resnet = {"conv_shortcut": "nin_shortcut"}
    attention = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    out = {}
    for key, value in state.items():
        new = key.replace("conv_norm_out", "norm_out")
        for side in ("encoder", "decoder"):
            new = new.replace(f"{side}.mid_block.resnets.0.", f"{side}.mid.block_1.")
            new = new.replace(f"{side}.mid_block.resnets.1.", f"{side}.mid.block_2.")
            if f"{side}.mid_block.attentions.0." in new:
                module, param = new.rsplit(".", 1)
                inner = module.split("attentions.0.", 1)[1]
                new = f"{side}.mid.attn_1.{attention[inner]}.{param}"
                if value.ndim == 2:
                    value = value[:, :, None, None]
        if new.startswith("encoder.down_blocks."):
            parts = new.split(".")
            rest = ".".join(parts[3:]).replace("resnets.", "block.").replace("downsamplers.0.", "downsample.")
            new = f"encoder.down.{parts[2]}.{rest}"
        if new.startswith("decoder.up_blocks."):
            parts = new.split(".")
            rest = ".".join(parts[3:]).replace("resnets.", "block.").replace("upsamplers.0.", "upsample.")
            new = f"decoder.up.{levels - 1 - int(parts[2])}.{rest}"
        for old, ldm in resnet.items():
            new = new.replace(old, ldm)
        out[new] = value.contiguous()
    return out


_WAN_RESNET = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
               "conv2": "residual.6", "conv_shortcut": "shortcut"}
_WAN_SIMPLE = {"encoder.conv_in": "encoder.conv1", "decoder.conv_in": "decoder.conv1", "quant_conv": "conv1",
               "post_quant_conv": "conv2", "encoder.norm_out.gamma": "encoder.head.0.gamma",
               "encoder.conv_out": "encoder.head.2", "decoder.norm_out.gamma": "decoder.head.0.gamma",
               "decoder.conv_out": "decoder.head.2"}


_ROOT_BACK = {"quant_conv": "encoder.quant_conv", "post_quant_conv": "decoder.post_quant_conv",
              "encoder.conv_norm_out": "encoder.norm_out", "decoder.conv_norm_out": "decoder.norm_out"}
_COMFY_ROOT_BACK = {"quant_conv": "quant_conv", "post_quant_conv": "post_quant_conv"}


def bfl_vae_names(state: dict, comfy: bool = False) -> dict:
    """``AutoencoderKLFlux2`` weights under BFL's names (``comfy``: ComfyUI's, quant convs at the top),
    attention weights as BFL's 1x1 convs.  The inverse of ``flux2_vae_released.bfl_vae_to_diffusers``."""
    up_levels = count_indices(state, "decoder.up_blocks.")
    resnet = {v: k for k, v in RESNET_NAMES.items()}
    attention = {v: k for k, v in ATTENTION_NAMES.items()}
    roots = {**_ROOT_BACK, **(_COMFY_ROOT_BACK if comfy else {})}
    out: dict = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        parts = module.split(".")
        if module in roots:
            name = roots[module]
        elif ".mid_block.resnets." in module:
            name = f"{parts[0]}.mid.block_{int(parts[3]) + 1}.{resnet[parts[4]]}"
        elif ".mid_block.attentions.0." in module:
            name = f"{parts[0]}.mid.attn_1.{attention['.'.join(parts[4:])]}"
            value = value[:, :, None, None] if ATTENTION_WEIGHT.match(key) else value
        elif module.startswith(("encoder.down_blocks.", "decoder.up_blocks.")):
            level = parts[2] if parts[0] == "encoder" else str(up_levels - 1 - int(parts[2]))
            where = "encoder.down" if parts[0] == "encoder" else "decoder.up"
            rest = f"block.{parts[4]}.{resnet[parts[5]]}" if parts[3] == "resnets" else \
                f"{parts[3][:-len('rs')]}.conv"
            name = f"{where}.{level}.{rest}"
        else:  # conv_in, conv_out, bn.*
            name = module
        out[f"{name}.{param}"] = value.contiguous()
    return out


def _wan_resnet(rest: str) -> str:
    for diffusers, native in _WAN_RESNET.items():
        if rest == diffusers or rest.startswith(diffusers + "."):
            return native + rest[len(diffusers):]
    return rest


def wan_vae_names(state: dict) -> dict:
    """diffusers ``AutoencoderKLWan`` -> Wan's names (Wan2.1_VAE.pth), inverse of diffusers' convert_wan_vae_to_diffusers."""
    out = {}
    for key, value in state.items():
        module, param = key.rsplit(".", 1)
        full = next((n + key[len(d):] for d, n in _WAN_SIMPLE.items() if key == d or key.startswith(d + ".")), None)
        if full is not None:
            out[full] = value
            continue
        parts = module.split(".")
        side = parts[0]
        if parts[1] == "mid_block":
            index = {"resnets.0": "0", "resnets.1": "2", "attentions.0": "1"}[".".join(parts[2:4])]
            rest = ".".join(parts[4:]) + "." + param
            new = f"{side}.middle.{index}.{_wan_resnet(rest) if parts[2] == 'resnets' else rest}"
        elif parts[1] == "down_blocks":
            new = f"encoder.downsamples.{parts[2]}.{_wan_resnet('.'.join(parts[3:]) + '.' + param)}"
        else:  # decoder.up_blocks.B.resnets.R... / .upsamplers.0...
            block = int(parts[2])
            if parts[3] == "resnets":
                new = f"decoder.upsamples.{4 * block + int(parts[4])}.{_wan_resnet('.'.join(parts[5:]) + '.' + param)}"
            else:
                new = f"decoder.upsamples.{4 * block + 3}.{'.'.join(parts[5:])}.{param}"
        out[new] = value
    return out


def wan_transformer_names(state: dict) -> dict:
    return {native_name(k): v for k, v in state.items()}


# --- tiny models with the releases' facts -------------------------------------------------------------

def _qwen_components():
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = tiny_tokenizers.qwen2_tokenizer()
    ids = dict(bos_token_id=151643, eos_token_id=151645, image_token_id=151655, video_token_id=151656,
               vision_start_token_id=151652, vision_end_token_id=151653)
    text = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
                         num_key_value_heads=1, vocab_size=len(tok) + 8, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}, **ids),
        vision_config=dict(depth=1, hidden_size=80, intermediate_size=32, num_heads=1, out_hidden_size=128,
                           fullatt_block_indexes=[7, 15, 23, 31], window_size=112, tokens_per_second=2),
        vocab_size=len(tok) + 8, **ids))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, num_res_blocks=2)
    dit = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
                                      num_attention_heads=2, joint_attention_dim=128, axes_dims_rope=(4, 14, 14))
    return dict(text_encoder=text, tokenizer=tok, vae=vae, transformer=dit)


def _flux_components():
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = tiny_tokenizers.clip_tokenizer(), tiny_tokenizers.t5_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=64, intermediate_size=37,
                                        num_hidden_layers=2, num_attention_heads=1, max_position_embeddings=77,
                                        hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=768,
                                        bos_token_id=0, eos_token_id=2, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                 layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
                        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[32] * 4, layers_per_block=1,
                        norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                        use_post_quant_conv=False, sample_size=1024)
    dit = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=32,
                                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=64,
                                 guidance_embeds=True, axes_dims_rope=(4, 14, 14))
    return dict(text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok, vae=vae, transformer=dit)


def _wan_components():
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = tiny_tokenizers.t5_tokenizer()
    text = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                       layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, num_res_blocks=2)
    dit = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=1, attention_head_dim=128, in_channels=16,
                                out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=2)
    return dict(text_encoder=text, tokenizer=tok, vae=vae, transformer=dit)


def _z_image_components():
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from diffsynth_core.models.z_image import TRANSFORMER_CONFIGS

    tok = tiny_tokenizers.qwen2_tokenizer()
    text = Qwen3Model(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, vocab_size=len(tok) + 8, rms_norm_eps=1e-6,
                                  rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
                        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[32] * 4, layers_per_block=1,
                        norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                        use_post_quant_conv=False, sample_size=1024)
    dit = ZImageTransformer2DModel(**TRANSFORMER_CONFIGS["tiny"])  # the released facts, tiny sizes (text width 32)
    return dict(text_encoder=text, tokenizer=tok, vae=vae, transformer=dit)


def _pipeline(family: str, components: dict):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, QwenImagePipeline, UniPCMultistepScheduler, WanPipeline

    from diffsynth_core.models import flux, qwen_image

    if family == "qwen_image":
        return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**qwen_image.SCHEDULER_CONFIG), **components)
    if family == "flux":
        return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**flux.DEV_SCHEDULER), **components)
    if family == "z_image":
        from diffusers import ZImagePipeline

        from diffsynth_core.models import z_image

        return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**z_image.SCHEDULER_CONFIG), **components)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanPipeline(scheduler=scheduler, **components)


_BUILDERS = {"qwen_image": _qwen_components, "flux": _flux_components, "wan": _wan_components,
             "z_image": _z_image_components}


# --- the DiffSynth layout -----------------------------------------------------------------------------

def _save_shards(state: dict, folder: Path, stem: str, shards: int) -> None:
    """Split ``state`` over ``shards`` files named as the hub does (``stem-00001-of-00002.safetensors``)."""
    keys = sorted(state)
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(shards):
        part = {k: state[k].contiguous() for k in keys[n::shards]}
        save_file(part, str(folder / f"{stem}-{n + 1:05d}-of-{shards:05d}.safetensors"))


def _weights(folder: Path) -> dict:
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def _write_diffsynth_layout(family: str, reference: Path, root: Path) -> None:
    base = root / MODEL_IDS[family]
    if family == "z_image":  # as qwen_image; Z-Image.sh's transformer comes from the base model's folder
        _save_shards(_weights(reference / "transformer"), base / "transformer", "diffusion_pytorch_model", 2)
        _save_shards(_weights(reference / "transformer"), root / Z_IMAGE_BASE_ID / "transformer",
                     "diffusion_pytorch_model", 2)
        _save_shards(_weights(reference / "text_encoder"), base / "text_encoder", "model", 2)
        (base / "vae").mkdir(parents=True)
        shutil.copy(reference / "vae" / "diffusion_pytorch_model.safetensors", base / "vae")
        shutil.copytree(reference / "tokenizer", base / "tokenizer")
    elif family == "qwen_image":  # diffusers subfolders, weights only (DiffSynth's patterns leave config.json out)
        _save_shards(_weights(reference / "transformer"), base / "transformer", "diffusion_pytorch_model", 2)
        _save_shards(_weights(reference / "text_encoder"), base / "text_encoder", "model", 1)
        (base / "vae").mkdir(parents=True)
        shutil.copy(reference / "vae" / "diffusion_pytorch_model.safetensors", base / "vae")
        shutil.copytree(reference / "tokenizer", base / "tokenizer")
    elif family == "flux":  # BFL single files beside diffusers-layout text encoders
        base.mkdir(parents=True)
        save_file(diffusers_to_bfl(_weights(reference / "transformer")), str(base / "flux1-dev.safetensors"))
        save_file(ldm_vae_names(_weights(reference / "vae")), str(base / "ae.safetensors"))
        (base / "text_encoder").mkdir()
        shutil.copy(reference / "text_encoder" / "model.safetensors", base / "text_encoder" / "model.safetensors")
        _save_shards(_weights(reference / "text_encoder_2"), base / "text_encoder_2", "model", 2)
        for name in ("tokenizer", "tokenizer_2"):
            shutil.copytree(reference / name, base / name)
    else:  # Wan's original release: its own key names, .pth for the encoder and the VAE
        base.mkdir(parents=True)
        save_file(wan_transformer_names(_weights(reference / "transformer")),
                  str(base / "diffusion_pytorch_model.safetensors"))
        torch.save(umt5_to_native_t5(_weights(reference / "text_encoder")), base / "models_t5_umt5-xxl-enc-bf16.pth")
        torch.save(wan_vae_names(_weights(reference / "vae")), base / "Wan2.1_VAE.pth")
        shutil.copytree(reference / "tokenizer", base / "google" / "umt5-xxl")


def _write_diffsynth_flux2(reference: Path, base: Path, parts: str = "whole") -> None:
    """A FLUX.2 release as DiffSynth downloads it: weights without config.json, the DiT and the text encoder in
    shards, the VAE's one file, the tokenizer folder."""
    _save_shards(_weights(reference / "transformer"), base / "transformer", "diffusion_pytorch_model", 2)
    if parts == "transformer":
        return
    _save_shards(_weights(reference / "text_encoder"), base / "text_encoder", "model", 2)
    (base / "vae").mkdir(parents=True)
    shutil.copy(reference / "vae" / "diffusion_pytorch_model.safetensors", base / "vae")
    shutil.copytree(reference / "tokenizer", base / "tokenizer")


def _build_flux2_release(root: Path, seed: int) -> Path:
    """``root/reference-dev`` (Mistral), ``root/reference`` and ``root/reference-9b`` (Qwen3) in the diffusers
    layout, the family's tiny models (the releases' facts at tiny widths), and the releases' DiffSynth layouts."""
    from diffsynth_core.models import get_family

    for folder, (variant, layers) in FLUX2_REFERENCES.items():
        get_family("flux2", variant).save_tiny_model(root / folder, seed, layers=layers)
    for model_id, (folder, parts) in FLUX2_RELEASES.items():
        _write_diffsynth_flux2(root / folder, root / "models" / model_id, parts)
    return root


def build_release(family: str, root: Path, seed: int = 0) -> Path:
    """Write ``root/reference`` (diffusers layout) and ``root/models/<model_id>/...`` (DiffSynth's); returns root.
    ``family`` may also name a Wan release of wan_released_layouts.py (``wan-ti2v-5b`` ...)."""
    from .wan_released_layouts import MODEL_IDS as WAN_RELEASES, build_wan_release

    if family in WAN_RELEASES:
        return build_wan_release(family, root, seed)
    if family == "flux2":
        return _build_flux2_release(root, seed)
    with MODEL_INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        components = _BUILDERS[family]()
    _pipeline(family, components).save_pretrained(root / "reference")
    _write_diffsynth_layout(family, root / "reference", root / "models")
    return root
