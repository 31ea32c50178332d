"""Wan text-to-video: ``WanPipeline`` components, Wan2.1 (1.3B and 14B) and, as variants, Wan2.2.

Variants (``model.variant``, else told by the folder's ``model_index.json`` or the DiT file's shapes:
``wan22.variant_of``): ``t2v`` (Wan2.1, the base), ``ti2v-5b`` (48-channel DiT, Wan2.2 VAE at 16x, one
timestep per token; an optional first frame), ``t2v-a14b`` (two experts, ``transformer`` above the
boundary sigma, ``transformer_2`` below), and the image-to-video ``i2v`` (Wan2.1 I2V 14B, with CLIP),
``i2v-a14b`` and ``i2v-a14b-expert`` (one of its experts alone) (models/wan_i2v.py).

Conventions (diffusers 0.42):
* prompt: UMT5 last hidden state cut at the prompt's true length and zero-padded to
  ``max_sequence_length`` -> ``prompt_embeds (L, D)``; ``L`` defaults to 512 capped by the tokenizer's
  ``model_max_length`` (32 for the tiny model).
* pixels ``(3, F, H, W)`` with ``F = 4k+1`` -> ``latents (16, k+1, H/8, W/8)``: the VAE posterior **mode**
  (mean), normalised ``(z - latents_mean) / latents_std`` per channel, in the VAE's dtype.
* DiT: un-packed 5-D latents, ``timestep = 1000 * sigma`` in fp32 (the time embedder is an fp32 module).
* LoRA for ComfyUI needs Wan's native names (``diffusion_model.blocks.N.self_attn.q``...) with
  ``.alpha`` tensors: ComfyUI has no mapping from diffusers names for Wan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

import functools

from . import encoders, lora_export, single_file, tiny_tokenizers, wan22, wan_i2v, wan_released
from ..errors import InputError
from .base import Components, Expert, FamilySpec, ReferenceRule
from .inputs import check_pixel_batch, check_pixels, prompt_length, t5_xxl_prompt_bytes, token_count
from .latents import per_channel_normalised_modes
from .loading import load_component
from .loading import load_components as _load_components
from .loading import MODEL_INIT_LOCK, module_dtype
from .random_models import build_random_transformer, random_module, random_tensor

PIPELINE_CLASS = "WanPipeline"
ENCODER_COMPONENTS = ("text_encoder", "tokenizer", "vae")
EXPERT_COMPONENTS = ("transformer", "transformer_2")  # Wan2.2 A14B: high noise, low noise
DEFAULT_MAX_SEQUENCE_LENGTH = 512
NUM_TRAIN_TIMESTEPS = 1000
VAE_SCALE = 8  # Wan2.1 VAE; the Wan2.2 VAE (TI2V-5B) compresses 16x
PATCH = 2
FRAME_MULTIPLE = 4  # the VAE compresses 4 frames into one latent frame, plus the first frame

# Diffusers name -> Wan native name, for modules outside the blocks (exact names).
_NATIVE_ROOT = {
    "scale_shift_table": "head.modulation",
    "proj_out": "head.head",
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    # Wan2.1 I2V's CLIP image embedder (diffusers' convert_wan_transformer_to_diffusers, inverted)
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
}
# Diffusers -> native pieces inside ``blocks.N.`` (the inverse of diffusers' converter; norm2/norm3 swap).
_NATIVE_BLOCK = {
    "attn1": "self_attn", "attn2": "cross_attn", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o",
    "add_k_proj": "k_img", "add_v_proj": "v_img", "norm_added_k": "norm_k_img", "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2", "scale_shift_table": "modulation", "norm2": "norm3", "norm3": "norm2",
    "norm_q": "norm_q", "norm_k": "norm_k",
}


def native_name(name: str) -> str:
    """Wan's original name of a diffusers module or parameter (``blocks.0.attn1.to_q`` -> ``blocks.0.self_attn.q``)."""
    for diffusers_name, native in _NATIVE_ROOT.items():
        if name == diffusers_name or name.startswith(diffusers_name + "."):
            return native + name[len(diffusers_name):]
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blocks":
        raise ValueError(f"no Wan native name for {name!r}")
    rest, out = ".".join(parts[2:]), []
    while rest:
        match = next((d for d in sorted(_NATIVE_BLOCK, key=len, reverse=True)
                      if rest == d or rest.startswith(d + ".")), None)
        if match is None:
            if rest in ("weight", "bias"):
                out.append(rest)
                break
            raise ValueError(f"no Wan native name for {name!r} (at {rest!r})")
        out.append(_NATIVE_BLOCK[match])
        rest = rest[len(match) + 1:]
    return ".".join(parts[:2] + out)


def diffusers_module_name(native: str) -> str | None:
    """The inverse of :func:`native_name` for module names (``blocks.0.self_attn.q`` -> ``blocks.0.attn1.to_q``);
    None for a name Wan's release does not use."""
    for diffusers_name, root in _NATIVE_ROOT.items():
        if native == root:
            return diffusers_name
    parts = native.split(".")
    if len(parts) < 3 or parts[0] != "blocks":
        return None
    inverse = {v: k for k, v in _NATIVE_BLOCK.items()}
    rest, out = ".".join(parts[2:]), []
    while rest:
        match = next((n for n in sorted(inverse, key=len, reverse=True) if rest == n or rest.startswith(n + ".")), None)
        if match is None:
            return None
        out.append(inverse[match])
        rest = rest[len(match) + 1:]
    return ".".join(parts[:2] + out)


# DiT layouts: the tiny test model and the released T2V ones (14.29 B / 1.42 B parameters).
TRANSFORMER_CLASS = "WanTransformer3DModel"
_WAN21 = dict(patch_size=(1, PATCH, PATCH), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
              attention_head_dim=128, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
              rope_max_seq_len=1024)
TRANSFORMER_CONFIGS = {
    "tiny": dict(patch_size=(1, PATCH, PATCH), num_attention_heads=2, attention_head_dim=24, in_channels=16,
                 out_channels=16, text_dim=32, freq_dim=256, ffn_dim=128, num_layers=2),
    "Wan2.1-T2V-14B": dict(_WAN21, num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "Wan2.1-T2V-1.3B": dict(_WAN21, num_attention_heads=12, ffn_dim=8960, num_layers=30),
    # Wan2.2: TI2V-5B over 48-channel latents; each A14B expert is a Wan2.1-14B-shaped DiT.
    "tiny-ti2v": dict(patch_size=(1, PATCH, PATCH), num_attention_heads=2, attention_head_dim=24, in_channels=48,
                      out_channels=48, text_dim=32, freq_dim=256, ffn_dim=128, num_layers=2),
    # I2V: 36 input channels (latents, mask, condition); Wan2.1's cross-attends CLIP image tokens too.
    "tiny-i2v": dict(patch_size=(1, PATCH, PATCH), num_attention_heads=2, attention_head_dim=24, in_channels=36,
                     out_channels=16, text_dim=32, freq_dim=256, ffn_dim=128, num_layers=2, image_dim=32,
                     added_kv_proj_dim=48),
    "tiny-i2v-a14b": dict(patch_size=(1, PATCH, PATCH), num_attention_heads=2, attention_head_dim=24, in_channels=36,
                          out_channels=16, text_dim=32, freq_dim=256, ffn_dim=128, num_layers=2),
    "Wan2.2-TI2V-5B": dict(_WAN21, in_channels=48, out_channels=48, num_attention_heads=24, ffn_dim=14336,
                           num_layers=30),
    "Wan2.2-T2V-A14B": dict(_WAN21, num_attention_heads=40, ffn_dim=13824, num_layers=40),
}


def _pipeline_cls():
    from diffusers import WanPipeline

    return WanPipeline


# --- tiny model --------------------------------------------------------------------------

def save_tiny_model(out_dir: Path, seed: int = 0, *, variant: str = "t2v") -> Path:
    """Tiny random Wan in the diffusers layout (UniPC flow scheduler, shift 3, like the release):
    ``t2v`` Wan2.1; ``ti2v-5b`` the Wan2.2 VAE and a 48-channel DiT, per-token timesteps;
    ``t2v-a14b`` two experts (different seeds) switching at the release's boundary ratio; ``i2v``
    Wan2.1 I2V (36-channel DiT, a CLIP vision tower); ``i2v-a14b`` two 36-channel experts."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    tokenizer = tiny_tokenizers.t5_tokenizer()
    layout = {"ti2v-5b": "tiny-ti2v", "i2v": "tiny-i2v", "i2v-a14b": "tiny-i2v-a14b",
              "i2v-a14b-expert": "tiny-i2v-a14b"}.get(variant, "tiny")
    extra: dict[str, Any] = {}
    with MODEL_INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
        if variant == "ti2v-5b":
            vae = AutoencoderKLWan(**wan22.VAE22_TINY)
        else:
            vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                   temperal_downsample=[False, True, True])
        transformer = WanTransformer3DModel(**TRANSFORMER_CONFIGS[layout])
        if variant in wan22.BOUNDARY_RATIO:
            extra.update(transformer_2=WanTransformer3DModel(**TRANSFORMER_CONFIGS[layout]),
                         boundary_ratio=wan22.BOUNDARY_RATIO[variant])
        if variant == "i2v":  # CLIP ViT at tiny widths: 32 px, 8 px patches -> 17 tokens of 32
            extra.update(image_encoder=CLIPVisionModel(CLIPVisionConfig(
                hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                patch_size=8)), image_processor=CLIPImageProcessor(crop_size=32, size={"shortest_edge": 32}))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=NUM_TRAIN_TIMESTEPS, flow_shift=3.0)
    if variant == "ti2v-5b":
        extra["expand_timesteps"] = True
    pipeline = WanImageToVideoPipeline if variant.startswith("i2v") else _pipeline_cls()
    pipe = pipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                    transformer=transformer, **extra)
    pipe.save_pretrained(out_dir)
    return Path(out_dir)


# --- loading -------------------------------------------------------------------------------

def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str) -> Components:
    return _load_components(path, names, dtype, device,
                            allowed=ENCODER_COMPONENTS + EXPERT_COMPONENTS + wan_i2v.FOLDER_IMAGE_COMPONENTS)


def load_encoders(path: Path, dtype: torch.dtype, *, names: tuple[str, ...] = ENCODER_COMPONENTS) -> Components:
    """What encoding reads, on the CPU: UMT5 (already encoder-only), its tokenizer, the VAE without
    its decoder (and Wan2.1 I2V's CLIP tower and processor)."""
    comps = {name: load_component(path, name, dtype) for name in names}
    comps["vae"] = encoders.without_decoder(comps["vae"])
    return comps


def _convert_native(state_dict: single_file.StateDict) -> single_file.StateDict:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(dict(state_dict))


def load_transformer_file(file: Path, config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Single-file DiT with diffusers or Wan native names (ComfyUI prefixes stripped); fp32 modules stay fp32."""
    from diffusers import WanTransformer3DModel

    return single_file.load_transformer_file(WanTransformer3DModel, file, config_dir, dtype, convert=_convert_native)


# --- encoding ------------------------------------------------------------------------------

def encode_prompts(components: Components, prompts: list[str], device: str, *,
                   max_sequence_length: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``WanPipeline.encode_prompt`` (no CFG) for a batch, each zero-padded to the max length."""
    tokenizer = components["tokenizer"]
    max_sequence_length = prompt_length(tokenizer, max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH)
    pipe = _pipeline_cls()(tokenizer=tokenizer, text_encoder=components["text_encoder"], vae=None,
                           scheduler=None, transformer=None)
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                       device=torch.device(device), max_sequence_length=max_sequence_length)
    return [{"prompt_embeds": one} for one in embeds]


def encode_prompt(components: Components, prompt: str, device: str, *,
                  max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
    """``WanPipeline.encode_prompt`` (no CFG) for one prompt, zero-padded to the max length, no batch dim."""
    return encode_prompts(components, [prompt], device, max_sequence_length=max_sequence_length)[0]


def encode_pixel_batch(components: Components, pixels: torch.Tensor, device: str, *,
                       vae_scale: int = VAE_SCALE) -> list[dict[str, torch.Tensor]]:
    """VAE posterior modes of ``(B, 3, F, H, W)``, normalised per channel: each ``(C, (F-1)/4+1, H/s, W/s)``
    (Wan2.1: C = 16, s = 8; Wan2.2's VAE: C = 48, s = 16)."""
    check_pixel_batch(pixels, multiple=vae_scale * PATCH, frame_multiple=FRAME_MULTIPLE)
    return [{"latents": z} for z in per_channel_normalised_modes(components["vae"], pixels, device)]


def count_prompt_tokens(components: Components, prompt: str, *,
                        max_sequence_length: int | None = None) -> tuple[int, int]:
    """(T5 tokens of the cleaned ``prompt``, as WanPipeline tokenizes it, and tokens ``encode_prompt`` keeps)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    tokenizer = components["tokenizer"]
    kept = prompt_length(tokenizer, max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH)
    return token_count(tokenizer, prompt_clean(prompt)), kept


def encode_pixels(components: Components, pixels: torch.Tensor, device: str, *,
                  vae_scale: int = VAE_SCALE) -> dict[str, torch.Tensor]:
    """VAE posterior mode, normalised per channel: ``(C, (F-1)/4+1, H/s, W/s)``."""
    check_pixels(pixels, multiple=vae_scale * PATCH, frame_multiple=FRAME_MULTIPLE)
    return encode_pixel_batch(components, pixels[None], device, vae_scale=vae_scale)[0]


def vae_encode_bytes(frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one bf16 VAE encode (weights excluded) of the released layout:
    ~1840 bytes per pixel of a 5-frame window whatever the length (the causal VAE encodes 4 frames
    at a time, caching only the last ones); measured on an H200 with 81 frames at 480x832."""
    return 1840 * height * width * min(frames, 5)


def prompt_lengths(components: Components, prompts: list[str], *,
                   max_sequence_length: int | None = None) -> list[int]:
    """Tokens each prompt takes in a batch: umT5 always pads to the max length."""
    return [prompt_length(components["tokenizer"], max_sequence_length, DEFAULT_MAX_SEQUENCE_LENGTH)] * len(prompts)


# --- training forward ------------------------------------------------------------------------

def dit_forward(transformer: torch.nn.Module, latents: torch.Tensor, sigmas: torch.Tensor,
                cond: Mapping[str, torch.Tensor], *, per_token_timesteps: bool = False,
                concatenated_image: bool = False) -> torch.Tensor:
    """Velocity prediction ``(B, C, f, h, w)`` for latents ``(B, C, f, h, w)``; ``t = 1000 * sigma``.

    ``per_token_timesteps`` (TI2V-5B): ``t`` repeated for each latent token, ``(B, f * h/2 * w/2)``,
    as ``WanPipeline(expand_timesteps=True)`` passes it; with a first frame (``ref_latents_0``) that
    frame is the given one, at ``t = 0``.  ``concatenated_image`` (I2V 14B): the DiT takes
    ``[latents, ref_mask_0, ref_latents_0]`` and Wan2.1's CLIP ``image_embeds`` (models/wan_i2v.py)."""
    if latents.ndim != 5:
        raise ValueError(f"Wan latents must be (B, C, F, H, W), got shape {tuple(latents.shape)}")
    dtype = module_dtype(transformer)
    timestep = sigmas.float() * NUM_TRAIN_TIMESTEPS
    hidden, image = latents, None
    first_frame = per_token_timesteps and "ref_latents_0" in cond
    if concatenated_image:
        if "ref_latents_0" not in cond:
            raise InputError("Wan image-to-video trains on each clip's first-frame latents (ref_latents_0), which "
                             "this cache lacks: preprocess the dataset again with its input images")
        hidden, image = wan_i2v.concatenated_inputs(latents, cond), cond.get("image_embeds")
    if per_token_timesteps:
        _, p_h, p_w = transformer.config.patch_size
        frames, height, width = latents.shape[2:]
        per_frame = timestep[:, None].expand(-1, frames)
        if first_frame:
            hidden, mask = wan_i2v.with_first_frame(latents, cond)
            per_frame = per_frame * mask.view(-1, frames).float()
        timestep = per_frame.repeat_interleave((height // p_h) * (width // p_w), dim=1)
    out = transformer(
        hidden_states=hidden.to(dtype), timestep=timestep, encoder_hidden_states=cond["prompt_embeds"].to(dtype),
        encoder_hidden_states_image=None if image is None else image.to(dtype), return_dict=False,
    )[0]
    if first_frame:  # the given frame is not predicted (wan_i2v.given_frame_velocity)
        given = wan_i2v.given_frame_velocity(latents, sigmas, cond["ref_latents_0"]).to(out.dtype)
        out = torch.cat([given, out[:, :, 1:]], dim=2)
    return out


# --- without weights -------------------------------------------------------------------------

def build_transformer(variant: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return build_random_transformer(TRANSFORMER_CLASS, TRANSFORMER_CONFIGS, variant, dtype, device)


# Released encoder layouts (benchmarks): umT5-XXL's encoder (5.68 B parameters) and the Wan2.1 VAE.
ENCODER_CONFIGS = {
    "Wan2.1": {
        "umt5": dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                     relative_attention_num_buckets=32, relative_attention_max_distance=128,
                     feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6),
        "vae": {},  # AutoencoderKLWan's defaults are the Wan2.1 VAE
    },
}
ENCODER_CONFIGS["Wan2.2"] = dict(ENCODER_CONFIGS["Wan2.1"], vae=wan22.VAE22_RELEASED)  # TI2V-5B: umT5 + Wan2.2 VAE


def build_encoders(variant: str, dtype: torch.dtype, device: str) -> Components:
    """What ``load_encoders`` returns, with random weights in a released layout (benchmarks); the
    tiny tokenizer (the real vocabulary needs the hub) set to the released 512 tokens."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    layout = ENCODER_CONFIGS[variant]
    umt5 = random_module(lambda: UMT5EncoderModel._from_config(UMT5Config(**layout["umt5"]), dtype=dtype),
                         dtype, device)
    vae = random_module(lambda: AutoencoderKLWan(**layout["vae"]), dtype, device, seed=1)
    return {"text_encoder": umt5, "tokenizer": tiny_tokenizers.t5_tokenizer(DEFAULT_MAX_SEQUENCE_LENGTH),
            "vae": encoders.without_decoder(vae)}


def dummy_inputs(config: Mapping[str, Any], batch: int = 1, height: int = 64, width: int = 64, num_frames: int = 1,
                 text_len: int = 32, seed: int = 0, *, vae_scale: int = VAE_SCALE
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    check_pixels(torch.empty(3, num_frames, height, width, device="meta"), multiple=vae_scale * PATCH,
                 frame_multiple=FRAME_MULTIPLE)
    g = torch.Generator().manual_seed(seed)
    frames = (num_frames - 1) // FRAME_MULTIPLE + 1
    latents = random_tensor((batch, config["in_channels"], frames, height // vae_scale, width // vae_scale), g)
    return latents, {"prompt_embeds": random_tensor((batch, text_len, config["text_dim"]), g)}


# --- LoRA export -----------------------------------------------------------------------------

def export_lora(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                out_dir: Path, *, stem: str = "lora") -> dict[str, Path]:
    """diffusers, ComfyUI and DiffSynth files.  ComfyUI (comfy/ldm/wan/model.py) and DiffSynth
    (diffsynth/models/wan_video_dit.py) both use Wan's native names (``blocks.0.self_attn.q``)."""
    return lora_export.export_lora_files(
        _pipeline_cls(), peft_state_dict, lora_config, out_dir, stem=stem,
        comfyui_name=lambda module: "diffusion_model." + native_name(module),
        diffsynth_layout=lora_export.renamed(native_name))


# diffsynth/pipelines/wan_video.py: InputVideoEmbedder -> input_latents (1, 16, f, h, w), PromptEmbedder ->
# context (1, 512, 4096), zero past the prompt's length like ours.
DIFFSYNTH_CACHE_FIELDS = {"input_latents": "latents", "context": "prompt_embeds"}


def _experts(boundary: float) -> tuple[Expert, ...]:
    """The A14B experts in routing order: ``transformer`` serves sigma >= boundary (diffusers' ``t >=
    boundary_ratio * 1000``), ``transformer_2`` the rest."""
    return (Expert("transformer", boundary, 1.0, "high_noise"), Expert("transformer_2", 0.0, boundary, "low_noise"))


_TI2V_SCALE = 16  # the Wan2.2 VAE
I2V_PIPELINE_CLASS = "WanImageToVideoPipeline"
# I2V: one image, the clip's first frame unless the row gives one, at the target's size.
_I2V_REFERENCE = ReferenceRule(max_count=1, required=True, vae_area=None, match_target=True, first_frame_of_target=True)
# variant -> the spec fields it replaces (docs/design.md "Conditioning"); "t2v" is the base spec.
VARIANTS = {
    "t2v": {},
    "ti2v-5b": dict(
        encode_pixels=functools.partial(encode_pixels, vae_scale=_TI2V_SCALE),
        encode_pixel_batch=functools.partial(encode_pixel_batch, vae_scale=_TI2V_SCALE),
        dit_forward=functools.partial(dit_forward, per_token_timesteps=True),
        dummy_inputs=functools.partial(dummy_inputs, vae_scale=_TI2V_SCALE),
        save_tiny_model=functools.partial(save_tiny_model, variant="ti2v-5b"),
        # text-to-video, or image-to-video from a row's input image (its first latent frame given)
        references=ReferenceRule(max_count=1, required=False, vae_area=None, match_target=True),
        encode_references=wan_i2v.encode_first_frame,
        extras={"latent_channels": 48, "vae_scale_factor": _TI2V_SCALE, "pixel_multiple": _TI2V_SCALE * PATCH,
                "default_max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH,
                "num_train_timesteps": NUM_TRAIN_TIMESTEPS},
    ),
    "t2v-a14b": dict(
        experts=_experts(wan22.BOUNDARY_RATIO["t2v-a14b"]),
        save_tiny_model=functools.partial(save_tiny_model, variant="t2v-a14b"),
    ),
    "i2v": dict(
        encoder_components=ENCODER_COMPONENTS + wan_i2v.IMAGE_COMPONENTS,
        load_encoders=functools.partial(load_encoders, names=ENCODER_COMPONENTS + wan_i2v.FOLDER_IMAGE_COMPONENTS),
        references=_I2V_REFERENCE, encode_references=wan_i2v.encode_concatenated,
        dit_forward=functools.partial(dit_forward, concatenated_image=True),
        save_tiny_model=functools.partial(save_tiny_model, variant="i2v"), pipeline_class_name=I2V_PIPELINE_CLASS,
    ),
    # One I2V-A14B expert trained alone (DiffSynth's one-expert-per-run scripts; musubi's i2v-A14B with one
    # --dit): a 36-channel DiT without CLIP, its sigmas from train.sigma_range, as "t2v" is for a T2V expert.
    "i2v-a14b-expert": dict(
        references=_I2V_REFERENCE, encode_references=wan_i2v.encode_concatenated,
        dit_forward=functools.partial(dit_forward, concatenated_image=True),
        save_tiny_model=functools.partial(save_tiny_model, variant="i2v-a14b-expert"),
        pipeline_class_name=I2V_PIPELINE_CLASS,
    ),
    "i2v-a14b": dict(
        experts=_experts(wan22.BOUNDARY_RATIO["i2v-a14b"]),
        references=_I2V_REFERENCE, encode_references=wan_i2v.encode_concatenated,
        dit_forward=functools.partial(dit_forward, concatenated_image=True),
        save_tiny_model=functools.partial(save_tiny_model, variant="i2v-a14b"), pipeline_class_name=I2V_PIPELINE_CLASS,
    ),
}


SPEC = FamilySpec(
    name="wan",
    encoder_components=ENCODER_COMPONENTS,
    transformer_component="transformer",
    block_container_names=("blocks",),
    # DiffSynth's Wan defaults (q, k, v, o, ffn.0, ffn.2) in diffusers names; matches attn1 and attn2.
    lora_target_modules=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
    frame_multiple=FRAME_MULTIPLE,
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
    save_tiny_model=save_tiny_model,
    pipeline_class_name=PIPELINE_CLASS,
    count_prompt_tokens=count_prompt_tokens,
    transformer_variants=tuple(TRANSFORMER_CONFIGS),
    build_transformer=build_transformer,
    dummy_inputs=dummy_inputs,
    diffsynth_template="Wan",  # DiffSynth trains this family on its "Wan" schedule
    default_timestep_sampling="diffsynth",
    default_loss_weighting="diffsynth",
    encoder_variants=tuple(ENCODER_CONFIGS),
    build_encoders=build_encoders,
    diffsynth_cache_fields=DIFFSYNTH_CACHE_FIELDS,
    extras={"latent_channels": 16, "vae_scale_factor": VAE_SCALE, "pixel_multiple": VAE_SCALE * PATCH,
            "default_max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH, "num_train_timesteps": NUM_TRAIN_TIMESTEPS},
    released_formats=wan_released.FORMATS,
    lora_target_aliases=wan_released.DIFFSYNTH_LORA_NAMES,
    native_module_name=diffusers_module_name,
    variants=VARIANTS,
    variant="t2v",
    variant_of=wan22.variant_of,
)
