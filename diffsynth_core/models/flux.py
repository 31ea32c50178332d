"""FLUX.1 dev and schnell (text-to-image): ``FluxPipeline`` components.

Conventions (diffusers 0.42):
* prompt: T5 last hidden state padded to ``max_sequence_length`` -> ``prompt_embeds (L, D)`` and
  CLIP's pooled output -> ``pooled_prompt_embeds (D_clip,)``.  ``L`` defaults to 512 capped by the
  T5 tokenizer's ``model_max_length`` (32 for the tiny model).
* pixels ``(3, 1, H, W)`` -> ``latents (16, 1, H/8, W/8)``: the VAE posterior **mode** (mean),
  normalised ``(z - shift_factor) * scaling_factor``, in the VAE's dtype.  The frame axis is kept so
  every family caches ``(C, F, h, w)``.
* DiT: latents packed 2x2 into ``(B, h/2*w/2, 64)`` with ``img_ids`` ``[0, row, col]`` and zero
  ``txt_ids``; ``timestep = sigma`` (x1000 inside); dev (``guidance_embeds=True``) gets
  ``guidance = 3.5`` (x1000 inside), schnell none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from . import encoders, flux_released, lora_export, single_file, tiny_tokenizers
from .base import Components, FamilySpec
from .inputs import check_pixel_batch, check_pixels, prompt_length, t5_xxl_prompt_bytes, token_count
from .loading import load_component
from .loading import load_components as _load_components
from .loading import MODEL_INIT_LOCK, module_dtype, unwrap
from .random_models import build_random_transformer, random_module, random_tensor

PIPELINE_CLASS = "FluxPipeline"
ENCODER_COMPONENTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae")
DEFAULT_MAX_SEQUENCE_LENGTH = 512
TRAIN_GUIDANCE = 3.5  # what the diffusers FLUX-dev LoRA script feeds the guidance embedder
VAE_SCALE = 8
PATCH = 2

# Released scheduler configs: dev shifts dynamically with resolution, schnell is unshifted.
DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                     num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
SCHNELL_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                         num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


# DiT layouts: the tiny test model and the released ones (11.90 B parameters).
TRANSFORMER_CLASS = "FluxTransformer2DModel"
_FLUX1 = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
              num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))
TRANSFORMER_CONFIGS = {
    "tiny": dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=32,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                 axes_dims_rope=(8, 12, 12)),
    "FLUX.1-dev": dict(_FLUX1, guidance_embeds=True),
    "FLUX.1-schnell": dict(_FLUX1, guidance_embeds=False),
}


def _pipeline_cls():
    from diffusers import FluxPipeline

    return FluxPipeline


# --- tiny model --------------------------------------------------------------------------

def _tiny_text_encoders(clip_tok, t5_tok):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
    return clip, t5


def save_tiny_model(out_dir: Path, seed: int = 0, *, guidance_embeds: bool = True) -> Path:
    """Tiny random FLUX.1 in the diffusers layout; ``guidance_embeds=False`` gives a schnell-style model."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    clip_tok, t5_tok = tiny_tokenizers.clip_tokenizer(), tiny_tokenizers.t5_tokenizer()
    with MODEL_INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        clip, t5 = _tiny_text_encoders(clip_tok, t5_tok)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 16, 32, 32], layers_per_block=1,
            norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
            use_post_quant_conv=False)
        transformer = FluxTransformer2DModel(**dict(TRANSFORMER_CONFIGS["tiny"], guidance_embeds=guidance_embeds))
    scheduler = FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if guidance_embeds else SCHNELL_SCHEDULER))
    pipe = _pipeline_cls()(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok,
                           text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(out_dir)
    return Path(out_dir)


# --- loading -------------------------------------------------------------------------------

def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str) -> Components:
    return _load_components(path, names, dtype, device, allowed=ENCODER_COMPONENTS + ("transformer",))


def load_encoders(path: Path, dtype: torch.dtype) -> Components:
    """What encoding reads, on the CPU: CLIP-L, T5 (already encoder-only), both tokenizers, the VAE
    without its decoder."""
    comps = {name: load_component(path, name, dtype) for name in ENCODER_COMPONENTS}
    comps["vae"] = encoders.without_decoder(comps["vae"])
    return comps


def _convert_bfl(state_dict: single_file.StateDict) -> single_file.StateDict:
    """Original BFL names (double_blocks.N.img_attn.qkv ...) -> diffusers, with diffusers' converter.

    That converter hard-codes FLUX.1's width (inner_dim 3072), so it serves the released models only.
    """
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    return convert_flux_transformer_checkpoint_to_diffusers(dict(state_dict))


def load_transformer_file(file: Path, config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return single_file.load_transformer_file(FluxTransformer2DModel, file, config_dir, dtype, convert=_convert_bfl)


# --- encoding ------------------------------------------------------------------------------

def encode_prompts(components: Components, prompts: list[str], device: str, *,
                   max_sequence_length: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``FluxPipeline.encode_prompt`` for a batch (T5 padded to the max length), one dict per prompt."""
    tokenizer_2 = components["tokenizer_2"]
    max_sequence_length = prompt_length(tokenizer_2, max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH)
    pipe = _pipeline_cls()(scheduler=None, vae=None, text_encoder=components["text_encoder"],
                           tokenizer=components["tokenizer"], text_encoder_2=components["text_encoder_2"],
                           tokenizer_2=tokenizer_2, transformer=None)
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(list(prompts), prompt_2=None, device=torch.device(device),
                                               max_sequence_length=max_sequence_length)
    return [{"prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i]} for i in range(len(prompts))]


def encode_prompt(components: Components, prompt: str, device: str, *,
                  max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
    """``FluxPipeline.encode_prompt`` for one prompt (T5 padded to the max length), no batch dim."""
    return encode_prompts(components, [prompt], device, max_sequence_length=max_sequence_length)[0]


def encode_pixel_batch(components: Components, pixels: torch.Tensor, device: str) -> list[dict[str, torch.Tensor]]:
    """VAE posterior modes of ``(B, 3, 1, H, W)``, ``(z - shift) * scale``: each ``(16, 1, H/8, W/8)``."""
    check_pixel_batch(pixels, multiple=VAE_SCALE * PATCH, image_only=True)
    vae = components["vae"]
    with torch.no_grad():
        z = vae.encode(pixels[:, :, 0].to(device=device, dtype=vae.dtype)).latent_dist.mode()
    latents = ((z.float() - vae.config.shift_factor) * vae.config.scaling_factor).to(vae.dtype)
    return [{"latents": one[:, None]} for one in latents]


def count_prompt_tokens(components: Components, prompt: str, *,
                        max_sequence_length: int | None = None) -> tuple[int, int]:
    """(T5 tokens of ``prompt``, tokens ``encode_prompt`` keeps).  CLIP's 77-token cut is not counted:
    CLIP gives only the pooled vector, and FLUX always cuts it there."""
    tokenizer_2 = components["tokenizer_2"]
    kept = prompt_length(tokenizer_2, max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH)
    return token_count(tokenizer_2, prompt), kept


def encode_pixels(components: Components, pixels: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    """VAE posterior mode, ``(z - shift) * scale``: ``(16, 1, H/8, W/8)``."""
    check_pixels(pixels, multiple=VAE_SCALE * PATCH, image_only=True)
    return encode_pixel_batch(components, pixels[None], device)[0]


def vae_encode_bytes(frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one bf16 VAE encode (weights excluded) of the released layout,
    measured on an H200 at 1024x1024: ~1540 bytes per pixel."""
    return 1540 * height * width


def prompt_lengths(components: Components, prompts: list[str], *,
                   max_sequence_length: int | None = None) -> list[int]:
    """Tokens each prompt takes in a batch: T5-XXL always pads to the max length."""
    return [prompt_length(components["tokenizer_2"], max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH)] * len(prompts)


# --- training forward ------------------------------------------------------------------------

def dit_forward(transformer: torch.nn.Module, latents: torch.Tensor, sigmas: torch.Tensor,
                cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Velocity prediction ``(B, 16, 1, h, w)`` for latents ``(B, 16, 1, h, w)``."""
    pipe_cls = _pipeline_cls()
    b, c, f, h, w = latents.shape
    if f != 1:
        raise ValueError(f"FLUX latents must have one frame, got shape {tuple(latents.shape)}")
    dtype, device = module_dtype(transformer), latents.device
    packed = pipe_cls._pack_latents(latents[:, :, 0].to(dtype), b, c, h, w)
    embeds = cond["prompt_embeds"].to(dtype)
    guidance = None
    if unwrap(transformer).config.guidance_embeds:
        guidance = torch.full((b,), TRAIN_GUIDANCE, device=device, dtype=torch.float32)
    out = transformer(
        hidden_states=packed, timestep=sigmas.to(dtype), guidance=guidance,
        pooled_projections=cond["pooled_prompt_embeds"].to(dtype), encoder_hidden_states=embeds,
        txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
        img_ids=pipe_cls._prepare_latent_image_ids(b, h // PATCH, w // PATCH, device, dtype), return_dict=False,
    )[0]
    return pipe_cls._unpack_latents(out, h * VAE_SCALE, w * VAE_SCALE, VAE_SCALE)[:, :, None]


# --- without weights -------------------------------------------------------------------------

def build_transformer(variant: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return build_random_transformer(TRANSFORMER_CLASS, TRANSFORMER_CONFIGS, variant, dtype, device)


# Released encoder layouts (benchmarks): CLIP-L, T5-XXL's encoder (4.76 B parameters), the FLUX VAE.
ENCODER_CONFIGS = {
    "FLUX.1-dev": {
        "clip": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu"),
        "t5": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6),
        "vae": dict(in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 4,
                    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
                    shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
    },
}


def build_encoders(variant: str, dtype: torch.dtype, device: str) -> Components:
    """What ``load_encoders`` returns, with random weights in a released layout (benchmarks); tiny
    tokenizers (the real vocabularies need the hub), T5's set to the released 512 tokens."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    layout = ENCODER_CONFIGS[variant]
    clip = random_module(lambda: CLIPTextModel._from_config(CLIPTextConfig(**layout["clip"]), dtype=dtype),
                         dtype, device)
    t5 = random_module(lambda: T5EncoderModel._from_config(T5Config(**layout["t5"]), dtype=dtype), dtype, device)
    vae = random_module(lambda: AutoencoderKL(**layout["vae"]), dtype, device, seed=1)
    return {"text_encoder": clip, "tokenizer": tiny_tokenizers.clip_tokenizer(), "text_encoder_2": t5,
            "tokenizer_2": tiny_tokenizers.t5_tokenizer(DEFAULT_MAX_SEQUENCE_LENGTH),
            "vae": encoders.without_decoder(vae)}


def dummy_inputs(config: Mapping[str, Any], batch: int = 1, height: int = 64, width: int = 64, num_frames: int = 1,
                 text_len: int = 32, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    check_pixels(torch.empty(3, num_frames, height, width, device="meta"), multiple=VAE_SCALE * PATCH,
                 image_only=True)
    g = torch.Generator().manual_seed(seed)
    latents = random_tensor((batch, config["in_channels"] // 4, 1, height // VAE_SCALE, width // VAE_SCALE), g)
    cond = {"prompt_embeds": random_tensor((batch, text_len, config["joint_attention_dim"]), g),
            "pooled_prompt_embeds": random_tensor((batch, config["pooled_projection_dim"]), g)}
    return latents, cond


# --- LoRA export -----------------------------------------------------------------------------

# DiffSynth-Studio's FLUX DiT names (diffsynth/utils/state_dict_converters/flux_dit.py,
# FluxDiTStateDictConverterFromDiffusers): diffusers module -> DiffSynth module.
_DIFFSYNTH_GLOBAL = {
    "context_embedder": "context_embedder", "x_embedder": "x_embedder", "proj_out": "final_proj_out",
    "time_text_embed.timestep_embedder.linear_1": "time_embedder.timestep_embedder.0",
    "time_text_embed.timestep_embedder.linear_2": "time_embedder.timestep_embedder.2",
    "time_text_embed.guidance_embedder.linear_1": "guidance_embedder.timestep_embedder.0",
    "time_text_embed.guidance_embedder.linear_2": "guidance_embedder.timestep_embedder.2",
    "time_text_embed.text_embedder.linear_1": "pooled_text_embedder.0",
    "time_text_embed.text_embedder.linear_2": "pooled_text_embedder.2",
    "norm_out.linear": "final_norm_out.linear",  # DiffSynth swaps its (scale, shift) halves
}
_DIFFSYNTH_DOUBLE = {
    "norm1.linear": "norm1_a.linear", "norm1_context.linear": "norm1_b.linear", "attn.to_out.0": "attn.a_to_out",
    "attn.to_add_out": "attn.b_to_out", "ff.net.0.proj": "ff_a.0", "ff.net.2": "ff_a.2",
    "ff_context.net.0.proj": "ff_b.0", "ff_context.net.2": "ff_b.2",
}
_DIFFSYNTH_SINGLE = {"norm.linear": "norm.linear", "proj_out": "proj_out"}
# Fused DiffSynth Linears: diffusers parts in output order, and each part's width in q-widths.
_DIFFSYNTH_FUSED_DOUBLE = {"attn.a_to_qkv": (("attn.to_q", "attn.to_k", "attn.to_v"), (1, 1, 1)),
                           "attn.b_to_qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), (1, 1, 1))}
_DIFFSYNTH_FUSED_SINGLE = {"to_qkv_mlp": (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (1, 1, 1, 4))}


def _swap_halves(pair: lora_export.Pair) -> lora_export.Pair:
    down, up = pair
    half = up.shape[0] // 2
    return down, torch.cat([up[half:], up[:half]])


def _diffsynth_block(prefix: str, pairs: dict[str, lora_export.Pair], plain: dict, fused: dict) -> dict:
    out = {prefix + plain[name]: pair for name, pair in pairs.items() if name in plain}
    used = set(plain)
    for target, (parts, widths) in fused.items():
        members = [pairs.get(p) for p in parts]
        used.update(parts)
        if not any(m is not None for m in members):
            continue
        unit = next(m[1].shape[0] // w for m, w in zip(members, widths) if m is not None)
        out[prefix + target] = lora_export.fuse_pairs(members, [w * unit for w in widths])
    unknown = sorted(set(pairs) - used)
    if unknown:
        raise ValueError(f"no DiffSynth-Studio FLUX module for LoRA on {prefix}{unknown[0]}")
    return out


def _diffsynth_layout(pairs: dict[str, lora_export.Pair]) -> dict[str, lora_export.Pair]:
    """diffusers modules -> DiffSynth's FLUX DiT, with q/k/v (and single blocks' MLP input) fused."""
    blocks: dict[tuple[str, str], dict[str, lora_export.Pair]] = {}
    out = {}
    for module, pair in pairs.items():
        if module in _DIFFSYNTH_GLOBAL:
            out[_DIFFSYNTH_GLOBAL[module]] = _swap_halves(pair) if module == "norm_out.linear" else pair
            continue
        container, index, rest = (module.split(".", 2) + ["", ""])[:3]
        if container not in ("transformer_blocks", "single_transformer_blocks") or not index.isdigit():
            raise ValueError(f"no DiffSynth-Studio FLUX module for LoRA on {module}")
        blocks.setdefault((container, index), {})[rest] = pair
    for (container, index), members in blocks.items():
        if container == "transformer_blocks":
            out.update(_diffsynth_block(f"blocks.{index}.", members, _DIFFSYNTH_DOUBLE, _DIFFSYNTH_FUSED_DOUBLE))
        else:
            out.update(_diffsynth_block(f"single_blocks.{index}.", members, _DIFFSYNTH_SINGLE,
                                        _DIFFSYNTH_FUSED_SINGLE))
    return out


_FROM_DIFFSYNTH_GLOBAL = {v: k for k, v in _DIFFSYNTH_GLOBAL.items()}
_DIFFSYNTH_BLOCKS = {"blocks": ("transformer_blocks", _DIFFSYNTH_DOUBLE, _DIFFSYNTH_FUSED_DOUBLE),
                     "single_blocks": ("single_transformer_blocks", _DIFFSYNTH_SINGLE, _DIFFSYNTH_FUSED_SINGLE)}


def diffusers_module_name(name: str) -> str | lora_export.FusedLinear | None:
    """The diffusers module(s) of a DiffSynth FLUX DiT module (the inverse of ``_diffsynth_layout``), so
    a LoRA trained by DiffSynth, or splitflow's ``lora_diffsynth.safetensors``, continues here."""
    if name in _FROM_DIFFSYNTH_GLOBAL:
        module = _FROM_DIFFSYNTH_GLOBAL[name]
        return lora_export.FusedLinear((module,), (1,), swap_halves=True) if module == "norm_out.linear" else module
    container, index, rest = (name.split(".", 2) + ["", ""])[:3]
    if container not in _DIFFSYNTH_BLOCKS or not index.isdigit():
        return None
    ours, plain, fused = _DIFFSYNTH_BLOCKS[container]
    prefix = f"{ours}.{index}."
    inverse = {theirs: mine for mine, theirs in plain.items()}
    if rest in inverse:
        return prefix + inverse[rest]
    if rest in fused:
        parts, widths = fused[rest]
        return lora_export.FusedLinear(tuple(prefix + part for part in parts), widths)
    return None


def export_lora(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                out_dir: Path, *, stem: str = "lora") -> dict[str, Path]:
    """diffusers, ComfyUI and DiffSynth files.  ComfyUI maps ``transformer.<diffusers name>`` onto
    its fused BFL layers itself (comfy/lora.py, Flux branch) and reads ``.alpha``; DiffSynth's FLUX
    DiT has its own fused layers, so its file is laid out for them."""
    return lora_export.export_lora_files(
        _pipeline_cls(), peft_state_dict, lora_config, out_dir, stem=stem,
        comfyui_name=lambda module: "transformer." + module, diffsynth_layout=_diffsynth_layout)


# diffsynth/pipelines/flux_image.py: InputImageEmbedder -> input_latents (1, 16, h, w), PromptEmbedder ->
# prompt_emb (1, 512, 4096), pooled_prompt_emb (1, 768) and text_ids (ours are rebuilt in dit_forward).
DIFFSYNTH_CACHE_FIELDS = {"input_latents": "latents", "prompt_emb": "prompt_embeds",
                          "pooled_prompt_emb": "pooled_prompt_embeds"}


SPEC = FamilySpec(
    name="flux",
    encoder_components=ENCODER_COMPONENTS,
    transformer_component="transformer",
    block_container_names=("transformer_blocks", "single_transformer_blocks"),
    # The diffusers FLUX LoRA script's defaults (single blocks get attn.to_q/k/v through the suffix match).
    lora_target_modules=("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                         "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                         "ff_context.net.0.proj", "ff_context.net.2"),
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
    prompt_encode_bytes=t5_xxl_prompt_bytes,
    dit_forward=dit_forward,
    export_lora=export_lora,
    native_module_name=diffusers_module_name,  # DiffSynth-layout LoRAs (fused q/k/v) continue here
    save_tiny_model=save_tiny_model,
    pipeline_class_name=PIPELINE_CLASS,
    count_prompt_tokens=count_prompt_tokens,
    transformer_variants=tuple(TRANSFORMER_CONFIGS),
    build_transformer=build_transformer,
    dummy_inputs=dummy_inputs,
    diffsynth_template="FLUX.1",  # DiffSynth trains this family on its "FLUX.1" schedule
    default_timestep_sampling="diffsynth",
    default_loss_weighting="diffsynth",
    encoder_variants=tuple(ENCODER_CONFIGS),
    build_encoders=build_encoders,
    diffsynth_cache_fields=DIFFSYNTH_CACHE_FIELDS,
    extras={"latent_channels": 16, "vae_scale_factor": VAE_SCALE, "pixel_multiple": VAE_SCALE * PATCH,
            "default_max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH, "train_guidance": TRAIN_GUIDANCE},
    released_formats=flux_released.FORMATS,
    lora_target_aliases=flux_released.DIFFSYNTH_LORA_NAMES,
)
