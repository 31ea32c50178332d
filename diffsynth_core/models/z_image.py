"""Z-Image (Turbo and base; text-to-image): ``ZImagePipeline`` components.

Conventions (diffusers 0.42, pipelines/z_image/pipeline_z_image.py):
* prompt: the Qwen3 chat template (``enable_thinking=True``, generation prompt), tokenised padded
  to ``max_sequence_length`` (512); the text encoder's second-to-last hidden state at the real
  tokens -> ``prompt_embeds (L, D)`` and ``prompt_embeds_mask (L,)`` (ones; int64).  Prompts differ
  in length, so a batch pads both (the DiT takes one tensor per prompt, cut back by the mask).
* pixels ``(3, 1, H, W)`` -> ``latents (16, 1, H/8, W/8)``: the FLUX.1 VAE's posterior mode,
  ``(z - shift_factor) * scaling_factor`` (the inverse of the pipeline's decode step).
* DiT: a list of ``(16, 1, h, w)`` latents and a list of ``(L_i, D)`` prompts, timestep
  ``1 - sigma`` (the pipeline passes ``(1000 - t) / 1000``); the model predicts ``x0 - noise``,
  so the velocity is its negation (the pipeline's ``noise_pred = -noise_pred``).

Variants: ``turbo`` (Z-Image-Turbo, distilled for 8-step sampling) and ``base`` (Z-Image) share
every weight shape, so only the model id in the path tells them apart (``variant_of``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch

from . import encoders, lora_export, single_file, tiny_tokenizers, z_image_released
from .base import Components, FamilySpec
from .flux import encode_pixel_batch as _flux_vae_latents
from .flux import ENCODER_CONFIGS as _FLUX_ENCODERS
from .inputs import check_pixels, token_count
from .loading import load_component
from .loading import load_components as _load_components
from .loading import MODEL_INIT_LOCK, unwrap
from .random_models import build_random_transformer, random_module, random_tensor

PIPELINE_CLASS = "ZImagePipeline"
ENCODER_COMPONENTS = ("text_encoder", "tokenizer", "vae")
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.encode_prompt's default
VAE_SCALE = 8
PATCH = 2

# Z-Image-Turbo's scheduler (scheduler/scheduler_config.json of Tongyi-MAI/Z-Image-Turbo).
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

# DiT layouts: the tiny test model and the released one (Tongyi-MAI/Z-Image-Turbo transformer/config.json;
# Z-Image has the same), 6.15 B parameters.
TRANSFORMER_CLASS = "ZImageTransformer2DModel"
_RELEASED_FACTS = dict(all_patch_size=(PATCH,), all_f_patch_size=(1,), in_channels=16, norm_eps=1e-5, qk_norm=True,
                       rope_theta=256.0, t_scale=1000.0, axes_lens=(1536, 512, 512))
TRANSFORMER_CONFIGS = {
    "tiny": dict(_RELEASED_FACTS, dim=64, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                 axes_dims=(8, 12, 12)),
    "Z-Image-Turbo": dict(_RELEASED_FACTS, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                          cap_feat_dim=2560, axes_dims=(32, 48, 48)),
}

# What the reference implementation recommends when the distilled model is trained as a base model
# (DiffSynth-Studio examples/z_image/model_training/special/differential_training/Z-Image-Turbo.sh).
TURBO_TRAINING_NOTICE = (
    "Z-Image-Turbo is distilled: trained as a base model it loses its few-step sampling. DiffSynth-Studio "
    "recommends fusing the distillation-preserving ostris/zimage_turbo_training_adapter LoRA first "
    "(train.preset_lora_path, its --preset_lora_path), or training Z-Image (base) instead")


def _pipeline_cls():
    from diffusers import ZImagePipeline

    return ZImagePipeline


# --- tiny model --------------------------------------------------------------------------

def _tiny_text_encoder(vocab_size: int, pad_id: int):
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, vocab_size=vocab_size + 8, rms_norm_eps=1e-6,
                                  rope_theta=1000000.0, pad_token_id=pad_id, tie_word_embeddings=True))


def _tiny_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
                         up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 16, 32, 32],
                         layers_per_block=1, norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159,
                         use_quant_conv=False, use_post_quant_conv=False)


def save_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random Z-Image (Qwen3 text encoder, FLUX.1-style VAE) in the diffusers layout."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    tokenizer = tiny_tokenizers.qwen2_tokenizer()  # Qwen3's chat template renders the same text here
    with MODEL_INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = _tiny_text_encoder(len(tokenizer), tokenizer.pad_token_id)
        vae = _tiny_vae()
        transformer = ZImageTransformer2DModel(**TRANSFORMER_CONFIGS["tiny"])
    pipe = _pipeline_cls()(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                           text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(out_dir)
    return Path(out_dir)


# --- loading -------------------------------------------------------------------------------

def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str) -> Components:
    return _load_components(path, names, dtype, device, allowed=ENCODER_COMPONENTS + ("transformer",))


def load_transformer_file(file: Path, config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Single-file DiT: diffusers names, or Z-Image's original (ComfyUI) names with q/k/v fused."""
    from diffusers import ZImageTransformer2DModel

    return single_file.load_transformer_file(ZImageTransformer2DModel, file, config_dir, dtype,
                                             convert=z_image_released.native_to_diffusers)


def _text_weight_name(key: str) -> str | None:
    """Checkpoint key -> ``Qwen3Model`` name: ``model.layers...`` (a Qwen3ForCausalLM checkpoint) or
    ``layers...`` (a Qwen3Model one); None for the LM head, which encoding never runs."""
    if key.startswith("lm_head."):
        return None
    return key[len("model."):] if key.startswith("model.") else key


def load_encoders(path: Path, dtype: torch.dtype) -> Components:
    """What encoding reads, on the CPU: Qwen3 without an LM head, the tokenizer, the VAE without its decoder."""
    from transformers import AutoConfig, Qwen3Model

    folder = Path(path) / "text_encoder"
    text_encoder = encoders.load_submodel(folder, Qwen3Model, AutoConfig.from_pretrained(folder), dtype,
                                          _text_weight_name)
    return {"text_encoder": text_encoder, "tokenizer": load_component(path, "tokenizer", dtype),
            "vae": encoders.without_decoder(load_component(path, "vae", dtype))}


# --- encoding ------------------------------------------------------------------------------

def _text_pipeline(components: Components):
    return _pipeline_cls()(scheduler=None, vae=None, text_encoder=components.get("text_encoder"),
                           tokenizer=components["tokenizer"], transformer=None)


def encode_prompts(components: Components, prompts: list[str], device: str, *,
                   max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> list[dict[str, torch.Tensor]]:
    """``ZImagePipeline.encode_prompt`` for a batch: one ``(L_i, D)`` tensor per prompt, as it returns them."""
    with torch.no_grad():  # encode_prompt rewrites its list in place: give it a copy
        embeds, _ = _text_pipeline(components).encode_prompt(
            list(prompts), device=torch.device(device), do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length)
    return [{"prompt_embeds": e, "prompt_embeds_mask": torch.ones(e.shape[0], dtype=torch.long, device=e.device)}
            for e in embeds]


def encode_prompt(components: Components, prompt: str, device: str, *,
                  max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> dict[str, torch.Tensor]:
    """``ZImagePipeline.encode_prompt`` for one prompt, without the batch dim."""
    return encode_prompts(components, [prompt], device, max_sequence_length=max_sequence_length)[0]


def _templated(tokenizer, prompt: str) -> str:
    """The text ``ZImagePipeline._encode_prompt`` tokenises for ``prompt``."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)


def count_prompt_tokens(components: Components, prompt: str, *,
                        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> tuple[int, int]:
    """(tokens of ``prompt`` in its chat template, tokens ``encode_prompt`` keeps)."""
    tokenizer = components["tokenizer"]
    return token_count(tokenizer, _templated(tokenizer, prompt)), max_sequence_length


def prompt_lengths(components: Components, prompts: list[str], *,
                   max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> list[int]:
    """Tokens each prompt takes in a batch: the pipeline pads every prompt to the max length."""
    return [max_sequence_length] * len(prompts)


def prompt_encode_bytes(tokens: int) -> int:
    """Activation bytes of one bf16 prompt padded to ``tokens`` through Qwen3-4B (width 2560): its 37
    hidden states (190 KB a token), the MLP (58 KB) and attention with memory-efficient kernels, ~300 KB
    a token in all (estimated from the widths, not measured)."""
    return 300_000 * tokens


def encode_pixel_batch(components: Components, pixels: torch.Tensor, device: str) -> list[dict[str, torch.Tensor]]:
    """VAE posterior modes of ``(B, 3, 1, H, W)``, ``(z - shift) * scale``: each ``(16, 1, H/8, W/8)``
    (the FLUX.1 VAE, normalised as FLUX.1 normalises it; the pixel checks are FLUX.1's too)."""
    return _flux_vae_latents(components, pixels, device)


def encode_pixels(components: Components, pixels: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    check_pixels(pixels, multiple=VAE_SCALE * PATCH, image_only=True)
    return encode_pixel_batch(components, pixels[None], device)[0]


def vae_encode_bytes(frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one bf16 VAE encode: FLUX.1's VAE, ~1540 bytes per pixel (measured there)."""
    return 1540 * height * width


# --- training forward ------------------------------------------------------------------------

def _prompt_list(cond: Mapping[str, torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The batch's prompts as the DiT takes them: each cut back to its own tokens (mask 1)."""
    embeds = cond["prompt_embeds"].to(dtype)
    mask = cond.get("prompt_embeds_mask")
    if mask is None:
        return list(embeds.unbind(0))
    return [e[m.bool()] for e, m in zip(embeds, mask)]


def _compute_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The DiT's compute dtype: its output projection's base weight dtype (``loading.module_dtype``
    reads ``proj_out``, which Z-Image names ``all_final_layer.2-1.linear``), LoRA or not."""
    proj = unwrap(transformer).all_final_layer[f"{PATCH}-1"].linear
    return getattr(proj, "base_layer", proj).weight.dtype


def dit_forward(transformer: torch.nn.Module, latents: torch.Tensor, sigmas: torch.Tensor,
                cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Velocity prediction ``(B, 16, 1, h, w)`` for latents ``(B, 16, 1, h, w)`` at noise levels ``sigmas``."""
    b, c, f, h, w = latents.shape
    if f != 1:
        raise ValueError(f"Z-Image latents must have one frame, got shape {tuple(latents.shape)}")
    dtype = _compute_dtype(transformer)
    # The pipeline's timestep is float32 whatever the model's dtype; 1 - sigma is its (1000 - t) / 1000.
    timestep = 1.0 - sigmas.to(torch.float32)
    out = transformer(list(latents.to(dtype).unbind(0)), timestep, _prompt_list(cond, dtype), return_dict=False)[0]
    return -torch.stack(out)


# --- variants ----------------------------------------------------------------------------------

_TURBO = re.compile(r"z[-_ ]?image[-_ ]?turbo", re.IGNORECASE)
_BASE = re.compile(r"(^|--)z[-_ ]?image([-_ ]base)?$", re.IGNORECASE)  # Tongyi-MAI/Z-Image, hub cache "models--…"


def variant_of(path: Path | None) -> str | None:
    """``turbo`` or ``base`` from the model id in the path (DiffSynth's ./models/Tongyi-MAI/Z-Image-Turbo/,
    the hub cache's models--Tongyi-MAI--Z-Image): their weights have the same shapes, so nothing else tells."""
    if path is None:
        return None
    parts = Path(path).parts
    if any(_TURBO.search(part) for part in parts):
        return "turbo"
    if any(_BASE.search(part) for part in parts):
        return "base"
    return None


EXTRAS = {"latent_channels": 16, "vae_scale_factor": VAE_SCALE, "pixel_multiple": VAE_SCALE * PATCH,
          "default_max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH}
# Sampling defaults as the releases' model cards give them (Turbo: 8 steps without CFG; base: 50 steps,
# CFG 4, as DiffSynth's validate scripts sample it); ``training_notice`` is logged when training starts.
VARIANTS = {
    "turbo": {"extras": {**EXTRAS, "distilled": True, "training_notice": TURBO_TRAINING_NOTICE,
                         "inference_steps": 8, "guidance_scale": 0.0}},
    "base": {"extras": {**EXTRAS, "distilled": False, "inference_steps": 50, "guidance_scale": 4.0}},
}


# --- without weights -------------------------------------------------------------------------

def build_transformer(variant: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return build_random_transformer(TRANSFORMER_CLASS, TRANSFORMER_CONFIGS, variant, dtype, device)


# Released encoder layouts (benchmarks): Qwen3-4B (Tongyi-MAI/Z-Image-Turbo text_encoder/config.json,
# 4.02 B parameters) and the FLUX.1 VAE.
ENCODER_CONFIGS = {
    "Z-Image-Turbo": {
        "text": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True),
        "vae": _FLUX_ENCODERS["FLUX.1-dev"]["vae"],
    },
}


def build_encoders(variant: str, dtype: torch.dtype, device: str) -> Components:
    """What ``load_encoders`` returns, with random weights in a released layout (benchmarks); the tiny
    test tokenizer (the real vocabulary needs the hub; its ids fit any vocabulary)."""
    from diffusers import AutoencoderKL
    from transformers import Qwen3Config, Qwen3Model

    layout = ENCODER_CONFIGS[variant]
    text = random_module(lambda: Qwen3Model._from_config(Qwen3Config(**layout["text"]), dtype=dtype), dtype, device)
    vae = random_module(lambda: AutoencoderKL(**layout["vae"]), dtype, device, seed=1)
    return {"text_encoder": text, "tokenizer": tiny_tokenizers.qwen2_tokenizer(), "vae": encoders.without_decoder(vae)}


def dummy_inputs(config: Mapping[str, Any], batch: int = 1, height: int = 64, width: int = 64, num_frames: int = 1,
                 text_len: int = 32, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    check_pixels(torch.empty(3, num_frames, height, width, device="meta"), multiple=VAE_SCALE * PATCH,
                 image_only=True)
    g = torch.Generator().manual_seed(seed)
    latents = random_tensor((batch, config["in_channels"], 1, height // VAE_SCALE, width // VAE_SCALE), g)
    cond = {"prompt_embeds": random_tensor((batch, text_len, config["cap_feat_dim"]), g),
            "prompt_embeds_mask": torch.ones(batch, text_len, dtype=torch.long)}
    return latents, cond


# --- LoRA export -----------------------------------------------------------------------------

def export_lora(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                out_dir: Path, *, stem: str = "lora") -> dict[str, Path]:
    """diffusers, ComfyUI and DiffSynth files.  ComfyUI maps ``diffusion_model.<diffusers name>`` onto its
    fused ``attention.qkv`` itself (comfy/lora.py, Lumina2 branch, through comfy/utils.py
    z_image_to_diffusers) and reads ``.alpha``; DiffSynth's Z-Image DiT (diffsynth/models/z_image_dit.py)
    uses the diffusers module names, so its file has the bare names."""
    return lora_export.export_lora_files(
        _pipeline_cls(), peft_state_dict, lora_config, out_dir, stem=stem,
        comfyui_name=lambda module: "diffusion_model." + module, diffsynth_layout=lora_export.renamed(str))


# diffsynth/pipelines/z_image.py: ZImageUnit_InputImageEmbedder -> input_latents (1, 16, h, w), FLUX.1's VAE
# normalised as ours (models/flux_vae.py: mode, (z - shift) * scale); ZImageUnit_PromptEmbedder ->
# prompt_embeds, a list of one (L, 2560) tensor (the prompt's own tokens: the import fills the mask with ones).
DIFFSYNTH_CACHE_FIELDS = {"input_latents": "latents", "prompt_embeds": "prompt_embeds"}


SPEC = FamilySpec(
    name="z_image",
    encoder_components=ENCODER_COMPONENTS,
    transformer_component="transformer",
    block_container_names=("noise_refiner", "context_refiner", "layers"),
    # DiffSynth-Studio's Z-Image LoRA scripts' targets (examples/z_image/model_training/lora/Z-Image*.sh)
    lora_target_modules=("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"),
    frame_multiple=1,
    load_components=load_components,
    load_transformer_file=load_transformer_file,
    encode_prompt=encode_prompt,
    encode_pixels=encode_pixels,
    load_encoders=load_encoders,
    encode_prompts=encode_prompts,
    encode_pixel_batch=encode_pixel_batch,
    vae_encode_bytes=vae_encode_bytes,
    prompt_lengths=prompt_lengths,
    prompt_encode_bytes=prompt_encode_bytes,
    dit_forward=dit_forward,
    export_lora=export_lora,
    save_tiny_model=save_tiny_model,
    pipeline_class_name=PIPELINE_CLASS,
    count_prompt_tokens=count_prompt_tokens,
    transformer_variants=tuple(TRANSFORMER_CONFIGS),
    build_transformer=build_transformer,
    dummy_inputs=dummy_inputs,
    batch_padding={"prompt_embeds": "prompt_embeds_mask"},
    diffsynth_template="Z-Image",  # FlowMatchScheduler("Z-Image"): shift 3, both variants
    default_timestep_sampling="diffsynth",
    default_loss_weighting="diffsynth",
    encoder_variants=tuple(ENCODER_CONFIGS),
    build_encoders=build_encoders,
    diffsynth_cache_fields=DIFFSYNTH_CACHE_FIELDS,
    extras=EXTRAS,
    released_formats=z_image_released.FORMATS,  # DiffSynth's Z-Image module names are diffusers'
    variants=VARIANTS,
    variant_of=variant_of,
)
