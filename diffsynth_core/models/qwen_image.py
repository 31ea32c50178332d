"""Qwen-Image (text-to-image): ``QwenImagePipeline`` components.

Conventions (diffusers 0.42):
* prompt: Qwen2.5-VL last hidden state of the chat template with its 34-token system prefix
  dropped -> ``prompt_embeds (L, D)`` and ``prompt_embeds_mask (L,)`` (ones; int64).  Batches of
  different prompt lengths are padded with zero embeddings and mask 0.
* pixels ``(3, 1, H, W)`` -> ``latents (16, 1, H/8, W/8)``: the VAE posterior **mode** (its mean),
  normalised ``(z - latents_mean) / latents_std`` per channel, in the VAE's dtype.
* DiT: latents packed 2x2 into ``(B, h/2*w/2, 64)``, ``timestep = sigma`` (x1000 inside the
  model), ``img_shapes`` from the latent shape, never ``guidance`` (its path is broken).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from . import encoders, lora_export, qwen_image_released, single_file, tiny_tokenizers
from .base import Components, FamilySpec
from .inputs import check_pixel_batch, check_pixels, token_count
from .latents import per_channel_normalised_modes
from .loading import load_component
from .loading import load_components as _load_components
from .loading import MODEL_INIT_LOCK, module_dtype
from .random_models import build_random_transformer, random_module, random_tensor

PIPELINE_CLASS = "QwenImagePipeline"
ENCODER_COMPONENTS = ("text_encoder", "tokenizer", "vae")
DEFAULT_MAX_SEQUENCE_LENGTH = 1024
VAE_SCALE = 8  # spatial down-sampling of AutoencoderKLQwenImage
PATCH = 2  # 2x2 latent patches per token

# FlowMatchEulerDiscreteScheduler config of the released Qwen-Image model.
SCHEDULER_CONFIG = dict(
    base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, num_train_timesteps=1000,
    shift=1.0, shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True,
)


# DiT layouts: the tiny test model and the released one (20.43 B parameters).
TRANSFORMER_CLASS = "QwenImageTransformer2DModel"
TRANSFORMER_CONFIGS = {
    "tiny": dict(patch_size=PATCH, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
                 num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12)),
    "Qwen-Image": dict(patch_size=PATCH, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                       axes_dims_rope=(16, 56, 56)),
}


def _pipeline_cls():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline


# --- tiny model --------------------------------------------------------------------------

# AutoencoderKLQwenImage at a tiny width (the released layout otherwise).
TINY_VAE_CONFIG = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                       temperal_downsample=[False, True, True])


def _tiny_text_encoder(vocab_size: int, eos_id: int, token_ids: Mapping[str, int] | None = None):
    """Tiny Qwen2.5-VL (vision tower included); ``token_ids``: the tokenizer's vision token ids
    (the edit variants' prompts hold images), else ids past the vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    v = vocab_size
    ids = dict(vision_start_token_id=v + 1, vision_end_token_id=v + 2, image_token_id=v + 3, video_token_id=v + 4)
    ids.update(token_ids or {})
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=v + 8, bos_token_id=eos_id, eos_token_id=eos_id,
                         pad_token_id=eos_id,
                         rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
        vocab_size=v + 8, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def save_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image (about 1 M parameters in all) in the diffusers layout."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    tokenizer = tiny_tokenizers.qwen2_tokenizer()
    with MODEL_INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = _tiny_text_encoder(len(tokenizer), tokenizer.eos_token_id)
        vae = AutoencoderKLQwenImage(**TINY_VAE_CONFIG)
        transformer = QwenImageTransformer2DModel(**TRANSFORMER_CONFIGS["tiny"])
    pipe = _pipeline_cls()(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                           text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(out_dir)
    return Path(out_dir)


# --- loading -------------------------------------------------------------------------------

def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str) -> Components:
    return _load_components(path, names, dtype, device, allowed=ENCODER_COMPONENTS + ("transformer",))


def load_transformer_file(file: Path, config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Single-file DiT: ComfyUI/diffusers keys are the same names here, so only prefixes are stripped."""
    from diffusers import QwenImageTransformer2DModel

    return single_file.load_transformer_file(QwenImageTransformer2DModel, file, config_dir, dtype)


def _text_weight_name(key: str) -> str | None:
    """Checkpoint key of Qwen2.5-VL -> name in its text decoder; None for the vision tower and LM head.

    Released folders use ``model.layers...`` (what transformers saves); transformers >= 4.52 names
    the same weights ``model.language_model.layers...`` in memory, so both are accepted.
    """
    if key.startswith("model.visual."):
        return None
    for prefix in ("model.language_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return None  # visual.*, lm_head.*


def load_encoders(path: Path, dtype: torch.dtype) -> Components:
    """What encoding reads, on the CPU: Qwen2.5-VL's text decoder alone (no vision tower, no LM
    head: prompts only need its last hidden state), the tokenizer, the VAE without its decoder."""
    from transformers import AutoConfig, Qwen2_5_VLTextModel

    folder = Path(path) / "text_encoder"
    text_config = AutoConfig.from_pretrained(folder).text_config
    text_encoder = encoders.load_submodel(folder, Qwen2_5_VLTextModel, text_config, dtype, _text_weight_name)
    return {"text_encoder": text_encoder, "tokenizer": load_component(path, "tokenizer", dtype),
            "vae": encoders.without_decoder(load_component(path, "vae", dtype))}


# --- encoding ------------------------------------------------------------------------------

def encode_prompts(components: Components, prompts: list[str], device: str, *,
                   max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> list[dict[str, torch.Tensor]]:
    """``QwenImagePipeline.encode_prompt`` for a batch: right-padded to the longest prompt, each
    result cut back to its own length (so it has the shape one-at-a-time encoding gives)."""
    pipe = _pipeline_cls()(scheduler=None, vae=None, text_encoder=components["text_encoder"],
                           tokenizer=components["tokenizer"], transformer=None)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(list(prompts), device=torch.device(device),
                                          max_sequence_length=max_sequence_length)
    if mask is None:  # the pipeline drops an all-ones mask; the cache keeps it for padding batches
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    lengths = mask.sum(dim=1).tolist()
    return [{"prompt_embeds": embeds[i, :n], "prompt_embeds_mask": mask[i, :n]} for i, n in enumerate(lengths)]


def encode_prompt(components: Components, prompt: str, device: str, *,
                  max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> dict[str, torch.Tensor]:
    """``QwenImagePipeline.encode_prompt`` for one prompt, without the batch dim."""
    return encode_prompts(components, [prompt], device, max_sequence_length=max_sequence_length)[0]


def encode_pixel_batch(components: Components, pixels: torch.Tensor, device: str) -> list[dict[str, torch.Tensor]]:
    """VAE posterior modes of ``(B, 3, 1, H, W)``, normalised per channel: each ``(16, 1, H/8, W/8)``."""
    check_pixel_batch(pixels, multiple=VAE_SCALE * PATCH, image_only=True)
    return [{"latents": z} for z in per_channel_normalised_modes(components["vae"], pixels, device)]


def count_prompt_tokens(components: Components, prompt: str, *,
                        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> tuple[int, int]:
    """(tokens of ``prompt`` after the pipeline's template prefix, tokens ``encode_prompt`` keeps)."""
    pipe = _pipeline_cls()(scheduler=None, vae=None, text_encoder=None, tokenizer=components["tokenizer"],
                           transformer=None)
    needed = token_count(pipe.tokenizer, pipe.prompt_template_encode.format(prompt))
    return needed - pipe.prompt_template_encode_start_idx, min(max_sequence_length, pipe.tokenizer_max_length)


def encode_pixels(components: Components, pixels: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    """VAE posterior mode, normalised per channel: ``(16, 1, H/8, W/8)``."""
    check_pixels(pixels, multiple=VAE_SCALE * PATCH, image_only=True)
    return encode_pixel_batch(components, pixels[None], device)[0]


def vae_encode_bytes(frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one bf16 VAE encode (weights excluded) of the released layout,
    measured on an H200 at 1328x1328: ~2700 bytes per pixel (it runs a frame at a time)."""
    return 2700 * height * width


def prompt_lengths(components: Components, prompts: list[str], *,
                   max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH) -> list[int]:
    """Tokens each prompt takes in a batch before padding: the chat template's included."""
    pipe = _pipeline_cls()(scheduler=None, vae=None, text_encoder=None, tokenizer=components["tokenizer"],
                           transformer=None)
    drop = pipe.prompt_template_encode_start_idx
    text = [pipe.prompt_template_encode.format(p) for p in prompts]
    ids = components["tokenizer"](text, max_length=pipe.tokenizer_max_length + drop, truncation=True).input_ids
    return [len(one) for one in ids]


def prompt_encode_bytes(tokens: int) -> int:
    """Activation bytes of one prompt padded to ``tokens`` (bf16, Qwen2.5-VL-7B's width): per token,
    the 29 hidden states the pipeline asks for (208 KB), the MLP (114 KB) and attention (memory-
    efficient kernels: ~80 KB)."""
    return 400_000 * tokens


# --- training forward ------------------------------------------------------------------------

def reference_latents(cond: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """``cond``'s ``ref_latents_0``, ``ref_latents_1``, ... in order (an edit's reference images)."""
    refs = []
    while f"ref_latents_{len(refs)}" in cond:
        refs.append(cond[f"ref_latents_{len(refs)}"])
    return refs


def dit_forward(transformer: torch.nn.Module, latents: torch.Tensor, sigmas: torch.Tensor,
                cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Velocity prediction ``(B, 16, 1, h, w)`` for latents ``(B, 16, 1, h, w)`` at noise levels ``sigmas``.

    Reference latents (``ref_latents_<i>``, each ``(B, 16, 1, h_i, w_i)``) are packed after the
    target's tokens with their own ``img_shapes``, as QwenImageEditPlusPipeline calls the
    transformer; the prediction is the target's tokens alone."""
    pipe_cls = _pipeline_cls()
    b, c, f, h, w = latents.shape
    if f != 1:
        raise ValueError(f"Qwen-Image latents must have one frame, got shape {tuple(latents.shape)}")
    dtype = module_dtype(transformer)
    tokens = [pipe_cls._pack_latents(latents[:, :, 0].to(dtype), b, c, h, w)]
    shapes = [(1, h // PATCH, w // PATCH)]
    for ref in reference_latents(cond):
        rh, rw = ref.shape[-2:]
        tokens.append(pipe_cls._pack_latents(ref[:, :, 0].to(dtype), b, ref.shape[1], rh, rw))
        shapes.append((1, rh // PATCH, rw // PATCH))
    mask = cond.get("prompt_embeds_mask")
    if mask is not None and bool(mask.all()):
        mask = None  # what the pipeline passes for unpadded prompts (and cheaper attention)
    out = transformer(
        hidden_states=torch.cat(tokens, dim=1), timestep=sigmas.to(dtype),
        encoder_hidden_states=cond["prompt_embeds"].to(dtype), encoder_hidden_states_mask=mask,
        img_shapes=[shapes] * b, return_dict=False,
    )[0]
    return pipe_cls._unpack_latents(out[:, : tokens[0].shape[1]], h * VAE_SCALE, w * VAE_SCALE, VAE_SCALE)


# --- without weights -------------------------------------------------------------------------

def build_transformer(variant: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return build_random_transformer(TRANSFORMER_CLASS, TRANSFORMER_CONFIGS, variant, dtype, device)


# Released encoder layouts (benchmarks): Qwen2.5-VL-7B's text decoder (7.07 B parameters) and the VAE.
ENCODER_CONFIGS = {
    "Qwen-Image": {
        "text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6, max_position_embeddings=128000,
                     rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}),
        "vae": {},  # AutoencoderKLQwenImage's defaults are the released VAE
    },
}


def build_encoders(variant: str, dtype: torch.dtype, device: str) -> Components:
    """What ``load_encoders`` returns, with random weights in a released layout (benchmarks).  The
    tokenizer is the tiny test one (the real vocabulary needs the hub); its ids fit any vocabulary."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLTextModel

    layout = ENCODER_CONFIGS[variant]
    text_config = Qwen2_5_VLConfig(text_config=layout["text"]).text_config
    text = random_module(lambda: Qwen2_5_VLTextModel._from_config(text_config, dtype=dtype), dtype, device)
    vae = random_module(lambda: AutoencoderKLQwenImage(**layout["vae"]), dtype, device, seed=1)
    return {"text_encoder": text, "tokenizer": tiny_tokenizers.qwen2_tokenizer(),
            "vae": encoders.without_decoder(vae)}


def dummy_inputs(config: Mapping[str, Any], batch: int = 1, height: int = 64, width: int = 64, num_frames: int = 1,
                 text_len: int = 32, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    check_pixels(torch.empty(3, num_frames, height, width, device="meta"), multiple=VAE_SCALE * PATCH,
                 image_only=True)
    g = torch.Generator().manual_seed(seed)
    latents = random_tensor((batch, config["in_channels"] // 4, 1, height // VAE_SCALE, width // VAE_SCALE), g)
    cond = {"prompt_embeds": random_tensor((batch, text_len, config["joint_attention_dim"]), g),
            "prompt_embeds_mask": torch.ones(batch, text_len, dtype=torch.long)}
    return latents, cond


# --- LoRA export -----------------------------------------------------------------------------

def export_lora(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                out_dir: Path, *, stem: str = "lora") -> dict[str, Path]:
    """diffusers, ComfyUI and DiffSynth files.  ComfyUI's and DiffSynth's Qwen-Image DiTs use the
    diffusers module names (comfy/ldm/qwen_image/model.py, diffsynth/models/qwen_image_dit.py),
    so ComfyUI gets ``diffusion_model.<name>`` + ``.alpha`` and DiffSynth the bare names."""
    return lora_export.export_lora_files(
        _pipeline_cls(), peft_state_dict, lora_config, out_dir, stem=stem,
        comfyui_name=lambda module: "diffusion_model." + module, diffsynth_layout=lora_export.renamed(str))


# diffsynth/pipelines/qwen_image.py: InputImageEmbedder -> input_latents (1, 16, h, w), PromptEmbedder ->
# prompt_emb (1, L, 3584) and prompt_emb_mask (1, L); on the edit models' rows EditImageEmbedder ->
# edit_latents, one (1, 16, h, w) tensor (Edit v1) or a list of them (2509, 2511): our ref_latents_<i>.
DIFFSYNTH_CACHE_FIELDS = {"input_latents": "latents", "prompt_emb": "prompt_embeds",
                          "prompt_emb_mask": "prompt_embeds_mask", "edit_latents": "ref_latents_{i}"}


# The edit variants (Edit v1, 2509, 2511) replace these fields; imported here, once everything
# they reuse from this module is defined.
from . import qwen_image_edit  # noqa: E402

SPEC = FamilySpec(
    name="qwen_image",
    encoder_components=ENCODER_COMPONENTS,
    transformer_component="transformer",
    block_container_names=("transformer_blocks",),
    lora_target_modules=("to_q", "to_k", "to_v", "to_out.0"),
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
    diffsynth_template="Qwen-Image",  # DiffSynth trains this family on its "Qwen-Image" schedule
    default_timestep_sampling="diffsynth",
    default_loss_weighting="diffsynth",
    encoder_variants=tuple(ENCODER_CONFIGS),
    build_encoders=build_encoders,
    diffsynth_cache_fields=DIFFSYNTH_CACHE_FIELDS,
    extras={"latent_channels": 16, "vae_scale_factor": VAE_SCALE, "pixel_multiple": VAE_SCALE * PATCH,
            "default_max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH},
    released_formats=qwen_image_released.FORMATS,  # DiffSynth's Qwen-Image module names are diffusers'
    variants=qwen_image_edit.VARIANTS,
    variant_of=qwen_image_edit.variant_of,
    # model.zero_cond_t (DiffSynth's --zero_cond_t): Edit-2511's reference modulation, over the files' config
    transformer_options={"zero_cond_t": qwen_image_edit.set_zero_cond_t},
)
