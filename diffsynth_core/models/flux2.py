"""FLUX.2 (dev, klein 4B / 9B, base and distilled): ``Flux2Pipeline`` / ``Flux2KleinPipeline`` components.

Conventions (diffusers 0.42, pipelines/flux2/pipeline_flux2.py and pipeline_flux2_klein.py):
* prompt: dev encodes with Mistral-Small-3.2 (its system message, the chat template), klein with Qwen3
  (the chat template, no thinking), both padded to ``max_sequence_length`` (512) and truncated there; the
  hidden states of layers (10, 20, 30) or (9, 18, 27) stacked along the width -> ``prompt_embeds (L, 3D)``.
  The prompt is text only: reference images never reach the text encoder.
* pixels ``(3, 1, H, W)`` -> ``latents (128, 1, H/16, W/16)``: the VAE posterior mode (32 channels at H/8)
  patchified 2x2 and normalised by the VAE's batch-norm statistics, as ``_encode_vae_image`` does.
* DiT: latents packed into ``(B, h*w, 128)`` tokens with ids ``(0, row, col, 0)``; the text's ids
  ``(0, 0, 0, l)``; reference latents (``ref_latents_<i>``, an edit's images) packed after the target with ids
  ``(10 + 10 i, row, col, 0)``; ``timestep = sigma`` (x1000 inside); dev gets guidance 1.0 (DiffSynth's and
  musubi-tuner's training value), klein none.  The prediction is the target's tokens alone.

Variants are data (``VARIANTS``): ``dev`` (Mistral), ``klein-4b``/``klein-9b`` (step-distilled) and
``klein-base-4b``/``klein-base-9b`` (klein's undistilled releases); ``flux2_released.variant_of`` tells them
from the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from . import encoders, flux2_lora, flux2_released, lora_export, single_file, tiny_tokenizers
from .base import Components, FamilySpec, ReferenceRule
from .inputs import check_pixel_batch, check_pixels
from .loading import MODEL_INIT_LOCK, load_component, module_dtype, unwrap
from .loading import load_components as _load_components
from .qwen_image import reference_latents
from .random_models import build_random_transformer, random_module, random_tensor

ENCODER_COMPONENTS = ("text_encoder", "tokenizer", "vae")
PIPELINES = {"mistral": "Flux2Pipeline", "qwen3": "Flux2KleinPipeline"}
DEFAULT_MAX_SEQUENCE_LENGTH = 512  # both pipelines' encode_prompt default
TRAIN_GUIDANCE = 1.0  # DiffSynth's examples/flux2/model_training/train.py and musubi's flux_2_train_network.py
VAE_SCALE, PATCH = 8, 2  # the VAE's down-sampling, then 2x2 latent patches: 16 pixels a token

# FlowMatchEulerDiscreteScheduler of the releases (black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json):
# the pipelines pass their own mu (compute_empirical_mu), so dynamic shifting is on.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                        max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)

# DiT layouts: the tiny test model (the releases' facts at tiny widths) and the released ones.
TRANSFORMER_CLASS = "Flux2Transformer2DModel"
_RELEASED = dict(in_channels=128, attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, patch_size=1)
TRANSFORMER_CONFIGS = {
    "tiny": dict(_RELEASED, in_channels=32, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
                 axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True),
    "FLUX.2-dev": dict(_RELEASED, num_layers=8, num_single_layers=48, num_attention_heads=48,
                       joint_attention_dim=15360, guidance_embeds=True),
    "FLUX.2-klein-4B": dict(_RELEASED, num_layers=5, num_single_layers=20, num_attention_heads=24,
                            joint_attention_dim=7680, guidance_embeds=False),
    "FLUX.2-klein-9B": dict(_RELEASED, num_layers=8, num_single_layers=24, num_attention_heads=32,
                            joint_attention_dim=12288, guidance_embeds=False),
}


def _pipeline_cls(kind: str):
    import diffusers

    return getattr(diffusers, PIPELINES[kind])


# --- tiny models --------------------------------------------------------------------------------

TINY_VAE = dict(block_out_channels=[32, 32, 32, 32], latent_channels=8, layers_per_block=1, norm_num_groups=32)


def tiny_vae():
    """``AutoencoderKLFlux2`` at tiny width with batch-norm statistics that are not the identity (so the
    normalisation is exercised)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**TINY_VAE)
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def tiny_mistral(vocab_size: int, layers: int = 30):
    """Mistral3 (text decoder and Pixtral vision tower) of 30 layers: the pipeline reads layers 10, 20, 30."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                num_attention_heads=1, num_key_value_heads=1, head_dim=flux2_released.MISTRAL_HEAD_DIM,
                vocab_size=vocab_size + 8, rms_norm_eps=1e-5, rope_theta=1e9, max_position_embeddings=131072,
                sliding_window=None, tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, patch_size=14, image_size=56)
    return Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision,
                                                           image_token_index=vocab_size + 1, spatial_merge_size=2))


def tiny_qwen3(vocab_size: int, layers: int = 27):
    """Qwen3 of 27 layers (the pipeline reads layers 9, 18, 27) with Qwen3-4B's facts at tiny width."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        vocab_size=vocab_size + 8, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                        max_position_embeddings=40960, tie_word_embeddings=True))


def save_tiny_model_for(kind: str, distilled: bool = False):
    def save_tiny_model(out_dir: Path, seed: int = 0, *, layers: tuple[int, int] | None = None) -> Path:
        """A tiny random FLUX.2 (dev: Mistral; klein: Qwen3) in the diffusers layout; ``layers``: its
        (double, single) block counts, a release's for scripts that name blocks (default 1, 2)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        tokenizer = tiny_tokenizers.mistral_tokenizer() if kind == "mistral" else tiny_tokenizers.qwen2_tokenizer()
        with MODEL_INIT_LOCK, torch.random.fork_rng():
            torch.manual_seed(seed)
            text_encoder = (tiny_mistral if kind == "mistral" else tiny_qwen3)(len(tokenizer))
            vae = tiny_vae()
            config = dict(TRANSFORMER_CONFIGS["tiny"], guidance_embeds=kind == "mistral")  # klein has no guidance
            if layers is not None:
                config.update(num_layers=layers[0], num_single_layers=layers[1])
            transformer = Flux2Transformer2DModel(**config)
        extra = {} if kind == "mistral" else {"is_distilled": distilled}
        pipe = _pipeline_cls(kind)(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                                   text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, **extra)
        pipe.save_pretrained(out_dir)
        return Path(out_dir)

    return save_tiny_model


# --- loading ------------------------------------------------------------------------------------

def _tokenizer(path: Path):
    """The tokenizer as DiffSynth loads it (``AutoTokenizer``): FLUX.2-dev's folder is a PixtralProcessor's,
    whose class needs torchvision, while encoding calls only its tokenizer's chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(path) / "tokenizer"))


def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str) -> Components:
    out = _load_components(path, tuple(n for n in names if n != "tokenizer"), dtype, device,
                           allowed=ENCODER_COMPONENTS + ("transformer",))
    if "tokenizer" in names:
        out["tokenizer"] = _tokenizer(path)
    kind = next((k for k, classes in _TEXT_CLASSES.items() if type(out.get("text_encoder")).__name__ in classes), None)
    if kind is not None:  # another class is refused when it encodes (_check_text_encoder)
        _reading_only(out, kind)
    return {name: out[name] for name in names}


def load_transformer_file(file: Path, config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Single-file DiT: diffusers names, or BFL's original names (flux2-dev.safetensors, ComfyUI's copies)."""
    from diffusers import Flux2Transformer2DModel

    return single_file.load_transformer_file(Flux2Transformer2DModel, file, config_dir, dtype,
                                             convert=flux2_released.bfl_to_diffusers)


# The hidden states each pipeline stacks (diffusers pipeline_flux2.py / pipeline_flux2_klein.py,
# ``hidden_states_layers``); the text encoder's layers after the last never run (``encoders.drop_layers_after``).
READ_LAYERS = {"mistral": (10, 20, 30), "qwen3": (9, 18, 27)}


def _reading_only(components: Components, kind: str) -> Components:
    if components.get("text_encoder") is not None:
        encoders.drop_layers_after(components["text_encoder"], max(READ_LAYERS[kind]))
    return components


def _load_mistral_encoders(path: Path, dtype: torch.dtype) -> Components:
    """What dev's encoding reads, on the CPU: Mistral's text decoder alone, the tokenizer, the VAE's encoder."""
    from transformers import AutoConfig, MistralModel

    folder = Path(path) / "text_encoder"
    config = AutoConfig.from_pretrained(folder)
    text_encoder = encoders.load_submodel(folder, MistralModel, getattr(config, "text_config", config), dtype,
                                          lambda key: flux2_released.mistral_text_name(key) or
                                          (key if config.model_type == "mistral" else None))
    return _reading_only({"text_encoder": text_encoder, "tokenizer": _tokenizer(path),
                          "vae": encoders.without_decoder(load_component(path, "vae", dtype))}, "mistral")


def _load_qwen3_encoders(path: Path, dtype: torch.dtype) -> Components:
    """klein's: Qwen3 without its LM head, the tokenizer, the VAE's encoder (Z-Image's loader reads the same)."""
    from .z_image import load_encoders

    return _reading_only(load_encoders(path, dtype), "qwen3")


# --- encoding -----------------------------------------------------------------------------------

_TEXT_CLASSES = {"mistral": ("MistralModel", "Mistral3ForConditionalGeneration", "Mistral3Model"),
                 "qwen3": ("Qwen3Model", "Qwen3ForCausalLM")}


def _check_text_encoder(kind: str, text_encoder) -> None:
    """A variant must get its own text encoder: Qwen3 run through dev's Mistral template (or the reverse)
    would encode without an error and train on meaningless prompts."""
    name = type(text_encoder).__name__
    if name not in _TEXT_CLASSES[kind]:
        from ..errors import InputError

        wanted = "Mistral3 (FLUX.2-dev)" if kind == "mistral" else "Qwen3 (FLUX.2-klein)"
        raise InputError(f"the text encoder is a {name}, but this FLUX.2 variant encodes with {wanted}: "
                         "set model.variant to the release the files are")


def encode_prompts_for(kind: str):
    def encode_prompts(components: Components, prompts: list[str], device: str, *,
                       max_sequence_length: int | None = None) -> list[dict[str, torch.Tensor]]:
        """The pipeline's own prompt encoding for a batch: ``(L, 3D)`` per prompt, padded to the max length."""
        text_encoder, tokenizer = components["text_encoder"], components["tokenizer"]
        _check_text_encoder(kind, text_encoder)
        length = max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        with torch.no_grad():
            if kind == "mistral":
                embeds = _pipeline_cls(kind)._get_mistral_3_small_prompt_embeds(
                    text_encoder=text_encoder, tokenizer=tokenizer, prompt=list(prompts),
                    device=torch.device(device), max_sequence_length=length, hidden_states_layers=READ_LAYERS[kind])
            else:
                embeds = _pipeline_cls(kind)._get_qwen3_prompt_embeds(
                    text_encoder=text_encoder, tokenizer=tokenizer, prompt=list(prompts),
                    device=torch.device(device), max_sequence_length=length, hidden_states_layers=READ_LAYERS[kind])
        return [{"prompt_embeds": one} for one in embeds]

    return encode_prompts


def encode_prompt_for(kind: str):
    encode_prompts = encode_prompts_for(kind)

    def encode_prompt(components: Components, prompt: str, device: str, *,
                      max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
        return encode_prompts(components, [prompt], device, max_sequence_length=max_sequence_length)[0]

    return encode_prompt


def _template_ids(kind: str, tokenizer, prompt: str) -> list[int]:
    """The token ids the pipeline's template makes of ``prompt``, before padding and truncation."""
    if kind == "mistral":
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        ids = tokenizer.apply_chat_template(format_input([prompt]), add_generation_prompt=False, tokenize=True,
                                            return_dict=True)["input_ids"]
        return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    return tokenizer(text, truncation=False, verbose=False).input_ids


def count_prompt_tokens_for(kind: str):
    def count_prompt_tokens(components: Components, prompt: str, *,
                            max_sequence_length: int | None = None) -> tuple[int, int]:
        """(tokens of ``prompt`` in its template, tokens ``encode_prompt`` keeps)."""
        return (len(_template_ids(kind, components["tokenizer"], prompt)),
                max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH)

    return count_prompt_tokens


def prompt_lengths(components: Components, prompts: list[str], *,
                   max_sequence_length: int | None = None) -> list[int]:
    """Tokens each prompt takes in a batch: both pipelines pad every prompt to the max length."""
    return [max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH] * len(prompts)


def mistral_prompt_bytes(tokens: int) -> int:
    """Activation bytes of one bf16 prompt through Mistral-Small-3.2 (width 5120) up to layer 30 (31 layers
    kept: ``READ_LAYERS``): the 32 hidden states the pipeline keeps (330 KB a token), the MLP (32768 wide:
    130 KB) and attention with memory-efficient kernels, ~520 KB a token (estimated from the widths; the
    benchmark's GPU peak checks it against the budget)."""
    return 520_000 * tokens


def qwen3_prompt_bytes(tokens: int) -> int:
    """As ``mistral_prompt_bytes`` for Qwen3-8B (width 4096; Qwen3-4B needs less) up to layer 27 (28 kept):
    29 hidden states (240 KB a token), the MLP and attention; ~400 KB a token, the figure for all 36 layers
    (estimated, not measured)."""
    return 400_000 * tokens


def encode_pixel_batch(components: Components, pixels: torch.Tensor, device: str) -> list[dict[str, torch.Tensor]]:
    """``_encode_vae_image`` of ``(B, 3, 1, H, W)``: each ``(128, 1, H/16, W/16)``."""
    check_pixel_batch(pixels, multiple=VAE_SCALE * PATCH, image_only=True)
    vae = components["vae"]
    pipe = _pipeline_cls("qwen3")(scheduler=None, vae=vae, text_encoder=None, tokenizer=None, transformer=None)
    with torch.no_grad():
        latents = pipe._encode_vae_image(pixels[:, :, 0].to(device=device, dtype=vae.dtype), generator=None)
    return [{"latents": one[:, None]} for one in latents]


def encode_pixels(components: Components, pixels: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    check_pixels(pixels, multiple=VAE_SCALE * PATCH, image_only=True)
    return encode_pixel_batch(components, pixels[None], device)[0]


def vae_encode_bytes(frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one bf16 VAE encode: the encoder has FLUX.1's layout (128-512 channels, two
    resnets a level), measured there at ~1540 bytes per pixel."""
    return 1540 * height * width


# --- training forward ---------------------------------------------------------------------------

def _tokens_and_ids(latents: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, C, h, w)`` -> tokens ``(B, h*w, C)`` and their ids ``(h*w, 4)``, as ``prepare_latents`` makes them."""
    pipe = _pipeline_cls("qwen3")
    return pipe._pack_latents(latents.to(dtype)), pipe._prepare_latent_ids(latents[:1])[0]


def dit_forward(transformer: torch.nn.Module, latents: torch.Tensor, sigmas: torch.Tensor,
                cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Velocity prediction ``(B, 128, 1, h, w)`` for latents ``(B, 128, 1, h, w)`` at noise levels ``sigmas``."""
    pipe = _pipeline_cls("qwen3")  # both pipelines share these static helpers
    b, c, f, h, w = latents.shape
    if f != 1:
        raise ValueError(f"FLUX.2 latents must have one frame, got shape {tuple(latents.shape)}")
    dtype, device = module_dtype(transformer), latents.device
    tokens, ids = _tokens_and_ids(latents[:, :, 0], dtype)
    refs = [ref[:, :, 0] for ref in reference_latents(cond)]
    if refs:  # prepare_image_latents: each reference packed after the target, time ids 10, 20, ...
        tokens = torch.cat([tokens, *(pipe._pack_latents(ref.to(dtype)) for ref in refs)], dim=1)
        ids = torch.cat([ids, pipe._prepare_image_ids([ref[:1] for ref in refs])[0].to(ids.device)])
    embeds = cond["prompt_embeds"].to(dtype)
    guidance = None
    if unwrap(transformer).config.guidance_embeds:
        guidance = torch.full((b,), TRAIN_GUIDANCE, device=device, dtype=torch.float32)
    out = transformer(hidden_states=tokens, encoder_hidden_states=embeds, timestep=sigmas.to(dtype),
                      img_ids=ids.to(device), txt_ids=pipe._prepare_text_ids(embeds[:1])[0].to(device),
                      guidance=guidance, return_dict=False)[0]
    return out[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)[:, :, None]


# --- variants -------------------------------------------------------------------------------------

# What the reference implementation recommends when a distilled klein is trained as a base model
# (musubi-tuner docs/flux_2.md; Black Forest Labs release the base models for fine-tuning).
KLEIN_TRAINING_NOTICE = (
    "FLUX.2-klein-{size} is step-distilled (4 steps, guidance 1): trained as a base model it loses its few-step "
    "sampling. Black Forest Labs release FLUX.2-klein-base-{size} for fine-tuning and LoRA training, and "
    "musubi-tuner recommends training klein base 4B or 9B")

EXTRAS = {"latent_channels": 128, "vae_scale_factor": VAE_SCALE * PATCH, "pixel_multiple": VAE_SCALE * PATCH,
          "default_max_sequence_length": DEFAULT_MAX_SEQUENCE_LENGTH}
# Released encoder layouts (benchmarks): Mistral-Small-3.2's text decoder (22.9 B parameters; DiffSynth's
# flux2_text_encoder.py), Qwen3-4B and Qwen3-8B (the klein releases' text_encoder/config.json), the VAE.
ENCODER_CONFIGS = {
    "FLUX.2-dev": dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                       rms_norm_eps=1e-5, rope_theta=1e9, max_position_embeddings=131072, sliding_window=None),
    "FLUX.2-klein-4B": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                            rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                            tie_word_embeddings=True),
    "FLUX.2-klein-9B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                            rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                            tie_word_embeddings=False),
}


def build_encoders(variant: str, dtype: torch.dtype, device: str) -> Components:
    """What ``load_encoders`` returns, with random weights in a released layout (benchmarks); the tiny test
    tokenizers (the real vocabularies need the hub; their ids fit any vocabulary)."""
    from diffusers import AutoencoderKLFlux2
    from transformers import MistralConfig, MistralModel, Qwen3Config, Qwen3Model

    layout = dict(ENCODER_CONFIGS[variant])
    mistral = layout.pop("model_type") == "mistral"
    model_cls, config = (MistralModel, MistralConfig(**layout)) if mistral else (Qwen3Model, Qwen3Config(**layout))
    text = random_module(lambda: model_cls._from_config(config, dtype=dtype), dtype, device)
    vae = random_module(lambda: AutoencoderKLFlux2(), dtype, device, seed=1)  # its defaults are the released VAE
    tokenizer = tiny_tokenizers.mistral_tokenizer() if mistral else tiny_tokenizers.qwen2_tokenizer()
    return _reading_only({"text_encoder": text, "tokenizer": tokenizer, "vae": encoders.without_decoder(vae)},
                         "mistral" if mistral else "qwen3")


def variant_fields(variant: str) -> dict[str, Any]:
    """The FamilySpec fields a variant replaces."""
    kind = "mistral" if variant == "dev" else "qwen3"
    size = variant.rsplit("-", 1)[-1].upper()
    distilled = variant in ("klein-4b", "klein-9b")
    extras = dict(EXTRAS, distilled=distilled, inference_steps=4 if distilled else 50,
                  guidance_scale=1.0 if distilled else 4.0)  # the releases' model cards
    if distilled:
        extras["training_notice"] = KLEIN_TRAINING_NOTICE.format(size=size)
    if kind == "mistral":
        extras["train_guidance"] = TRAIN_GUIDANCE
    return dict(
        pipeline_class_name=PIPELINES[kind],
        encode_prompt=encode_prompt_for(kind),
        encode_prompts=encode_prompts_for(kind),
        count_prompt_tokens=count_prompt_tokens_for(kind),
        prompt_encode_bytes=mistral_prompt_bytes if kind == "mistral" else qwen3_prompt_bytes,
        load_encoders=_load_mistral_encoders if kind == "mistral" else _load_qwen3_encoders,
        save_tiny_model=save_tiny_model_for(kind, distilled),
        encoder_variants=("FLUX.2-dev",) if kind == "mistral" else (f"FLUX.2-klein-{size}",),
        prompt_template=kind,  # base and distilled klein encode prompts alike: they share their cache entries
        extras=extras,
    )


# klein-base-4b first: what a folder that cannot tell stands for (the demo's tiny model), and the one to train.
VARIANTS = {name: variant_fields(name) for name in ("klein-base-4b", "klein-base-9b", "klein-4b", "klein-9b", "dev")}


# --- without weights -------------------------------------------------------------------------------

def build_transformer(variant: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return build_random_transformer(TRANSFORMER_CLASS, TRANSFORMER_CONFIGS, variant, dtype, device)


def dummy_inputs(config: Mapping[str, Any], batch: int = 1, height: int = 64, width: int = 64, num_frames: int = 1,
                 text_len: int = 32, seed: int = 0,
                 references: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Random cache entries for pixels of that size (``references``: reference latents of the target's size)."""
    multiple = VAE_SCALE * PATCH
    check_pixels(torch.empty(3, num_frames, height, width, device="meta"), multiple=multiple, image_only=True)
    g = torch.Generator().manual_seed(seed)
    latents = random_tensor((batch, config["in_channels"], 1, height // multiple, width // multiple), g)
    cond = {"prompt_embeds": random_tensor((batch, text_len, config["joint_attention_dim"]), g)}
    for i in range(references):
        cond[f"ref_latents_{i}"] = random_tensor(tuple(latents.shape), g)
    return latents, cond


# --- LoRA export -------------------------------------------------------------------------------------

def export_lora(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                out_dir: Path, *, stem: str = "lora") -> dict[str, Path]:
    """diffusers, ComfyUI and DiffSynth files.  ComfyUI's file has BFL's names in musubi/kohya's form
    (flux2_lora.py); DiffSynth's FLUX.2 DiT (diffsynth/models/flux2_dit.py) has the diffusers module names,
    so its file has the bare names.  Both pipelines share ``Flux2LoraLoaderMixin``."""
    return lora_export.export_lora_files(
        _pipeline_cls("qwen3"), peft_state_dict, lora_config, out_dir, stem=stem,
        comfyui_state_dict=flux2_lora.comfyui_state_dict, diffsynth_layout=lora_export.renamed(str))


SPEC = FamilySpec(
    name="flux2",
    encoder_components=ENCODER_COMPONENTS,
    transformer_component="transformer",
    block_container_names=("transformer_blocks", "single_transformer_blocks"),
    # DiffSynth-Studio's FLUX.2 LoRA scripts' targets (examples/flux2/model_training/lora/*.sh), which name
    # every single block's attn.to_out one by one: here one pattern.
    lora_target_modules=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                         "linear_in", "linear_out", "to_qkv_mlp_proj", "single_transformer_blocks.*.attn.to_out"),
    frame_multiple=1,
    load_components=load_components,
    load_transformer_file=load_transformer_file,
    encode_pixels=encode_pixels,
    encode_pixel_batch=encode_pixel_batch,
    vae_encode_bytes=vae_encode_bytes,
    prompt_lengths=prompt_lengths,
    dit_forward=dit_forward,
    export_lora=export_lora,
    native_module_name=flux2_lora.native_module_name,  # BFL / musubi-named LoRAs continue here
    transformer_variants=tuple(TRANSFORMER_CONFIGS),
    build_transformer=build_transformer,
    dummy_inputs=dummy_inputs,
    diffsynth_template="FLUX.2",  # FlowMatchScheduler("FLUX.2"): mu 0.8 on every variant
    default_timestep_sampling="diffsynth",
    default_loss_weighting="diffsynth",
    build_encoders=build_encoders,
    released_formats=flux2_released.FORMATS,
    # edit_image (a list): DiffSynth's Flux2Unit_EditImageEmbedder resizes each to about 1024x1024 pixels,
    # sides multiples of 32, by cover-and-crop (edit_image_auto_resize); the prompt sees no image.
    references=ReferenceRule(max_count=None, vae_area=1024 * 1024, vae_multiple=32, vae_crop=True),
    variants=VARIANTS,
    variant_of=flux2_released.variant_of,
    encoders_variant=flux2_released.encoders_variant,
    # the base spec is klein base 4B's (Qwen3 encodes its prompts); build_encoders knows dev's layout too
    **{**VARIANTS["klein-base-4b"], "encoder_variants": ("FLUX.2-klein-4B", "FLUX.2-klein-9B")},
)
