"""Qwen-Image-2.1: ``QwenImage21Pipeline`` components, text-to-image and multi-reference edit in one model.

Conventions (diffusers 0.42, pipelines/qwenimage21/pipeline_qwenimage21.py):
* prompt: Qwen3-VL's last decoder layer **before** its final norm (the pipeline neutralises the norm
  with a hook) over the pipeline's raw template, with the system message's tokens dropped, the
  prompt's reference images in it (``<imageN><|vision_start|><|image_pad|><|vision_end|>`` each,
  composited over white) -> ``prompt_embeds (L, D)``, ``prompt_embeds_mask (L,)`` (ones, int64) and
  ``image_pad_mask (L,)`` (bool: the positions that hold image slots, one per 2x2 latents).
* pixels ``(4, 1, H, W)`` RGBA (RGB gets an opaque alpha) -> ``latents (64, 1, H/16, W/16)``: the
  posterior mode, ``(z - latents_mean) / latents_std``.  Each reference is encoded at its own size
  (``ref_latents_<i>``), exactly the pixels the vision tower saw.
* DiT: latents unpatched (one token per latent), references first and the target last, each
  reference's tokens dropped into its prompt slots; ``timestep = sigma``; ``img_mask`` is the
  prompt's ``image_pad_mask`` plus one slot per 2x2 target latents.  ``causal_condition`` (the
  release's config) modulates text and references at t = 0 in training as at inference.  The
  transformer reads one slot layout per call, so samples of a batch whose prompts differ in
  length or layout go through it in groups, each at its own length (exactly its batch-of-one result).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from ..data.media import over_white
from ..errors import InputError
from . import encoders, lora_export, qwen_image, qwen_image21_released, qwen_vl_processor, single_file
from . import tiny_tokenizers
from .base import Components, FamilySpec, ReferenceRule
from .inputs import check_pixel_batch, check_pixels
from .latents import per_channel_normalised_modes
from .loading import MODEL_INIT_LOCK, load_component, module_dtype
from .loading import load_components as _load_components
from .qwen_image_edit import _vl_weight_name
from .random_models import build_random_transformer, random_module, random_tensor

PIPELINE_CLASS = "QwenImage21Pipeline"
ENCODER_COMPONENTS = ("text_encoder", "processor", "vae")
VAE_SCALE = 16      # spatial down-sampling of AutoencoderKLQwenImage21; the DiT takes its latents unpatched
SLOT = 2            # a prompt's image slot stands for SLOT x SLOT latents
PIXEL_MULTIPLE = VAE_SCALE * SLOT
REFERENCE_AREA = 1024 * 1024  # the pipeline's output_resolution ** 2, to which it resizes references
# The vision-prompt prefix of the image-conditioned template, repeated per reference (the pipeline's).
FIRST_IMAGE = "<image1><|vision_start|><|image_pad|><|vision_end|>"
NEXT_IMAGE = " <image{}><|vision_start|><|image_pad|><|vision_end|>"

TRANSFORMER_CLASS = "QwenImage21Transformer2DModel"
TRANSFORMER_CONFIGS = {
    "tiny": dict(patch_size=1, in_channels=64, out_channels=64, num_layers=2, attention_head_dim=32,
                 num_attention_heads=2, context_in_dim=128, mlp_ratio=3, axes_dims_rope=(4, 14, 14)),
    # Qwen/Qwen-Image-2.1 transformer/config.json: 7.0 B parameters
    "Qwen-Image-2.1": dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                           num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56),
                           causal_condition=True),
}
# AutoencoderKLQwenImage21 at a tiny width: four stages of 2x down-sampling (16x), 64 latent channels.
TINY_VAE_CONFIG = dict(base_dim=8, decoder_base_dim=8, z_dim=64, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                       temperal_downsample=[False, True, True, True])


def _pipeline_cls():
    from diffusers import QwenImage21Pipeline

    return QwenImage21Pipeline


# --- the pipeline's prompt facts --------------------------------------------------------------

def _prompt_facts(processor):
    """A pipeline holding only ``processor``: its templates, the system tokens it drops and the image-pad id."""
    return _pipeline_cls()(scheduler=None, vae=None, text_encoder=None, processor=processor, transformer=None)


def _template(facts, prompt: str, images: int) -> str:
    """``prompt`` in the pipeline's template, with ``images`` reference images before it."""
    prompt = prompt or " "  # the pipeline's: Qwen has no bos token, an empty prompt leaves nothing to read
    if images == 0:
        return facts.prompt_template_t2i.format(prompt)
    prefix = FIRST_IMAGE + "".join(NEXT_IMAGE.format(i) for i in range(2, images + 1))
    return facts.prompt_template_ti2i.replace(FIRST_IMAGE, prefix).format(prompt)


@contextlib.contextmanager
def _before_final_norm(language_model: torch.nn.Module):
    """The decoder's output before its final RMSNorm, which the DiT was trained on (the pipeline's hook)."""
    handle = language_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        yield
    finally:
        handle.remove()


def _check_slots(grid: torch.Tensor, images: list, processor) -> None:
    """Each image must reach the vision tower at its own size: its slots then cover its latents 2x2."""
    patch, size = processor.image_processor.patch_size, processor.image_processor.size
    for (_, rows, cols), image in zip(grid.tolist(), images):
        if (rows * patch, cols * patch) != (image.height, image.width):
            raise InputError(f"a {image.width}x{image.height} reference becomes {cols * patch}x{rows * patch} in the "
                             f"processor, which keeps images of {size['shortest_edge']} to {size['longest_edge']} "
                             f"pixels as they are; Qwen-Image-2.1 needs the vision tower and the VAE to see one size: "
                             f"set dataset.reference_pixels within that range")


# --- encoding ------------------------------------------------------------------------------------

def encode_prompts(components: Components, prompts: list[str], device: str, *, images: list[list] | None = None,
                   max_sequence_length: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``QwenImage21Pipeline.encode_prompt(prompt, image=...)`` for a batch, one image list per prompt
    (left-padded as the pipeline pads; each result cut to its own tokens).  The pipeline never truncates."""
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
    processor = components["processor"]
    facts = _prompt_facts(processor)
    rows = images if images is not None else [[] for _ in prompts]
    texts = [_template(facts, prompt, len(row)) for prompt, row in zip(prompts, rows)]
    flat = [over_white(image) for row in rows for image in row]
    inputs = processor(text=texts, images=flat or None, padding=True, padding_side="left", return_tensors="pt")
    if flat:
        _check_slots(inputs["image_grid_thw"], flat, processor)
    inputs = inputs.to(torch.device(device))
    encoder = components["text_encoder"]
    model = encoder.model if hasattr(encoder, "lm_head") else encoder  # Qwen3VLModel: no LM head's logits
    with torch.no_grad(), _before_final_norm(model.language_model):
        hidden = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       pixel_values=inputs.get("pixel_values"), image_grid_thw=inputs.get("image_grid_thw"),
                       mm_token_type_ids=inputs.get("mm_token_type_ids"), use_cache=False).last_hidden_state
    results = []
    for ids, mask, states in zip(inputs["input_ids"], inputs["attention_mask"], hidden):
        keep = mask.bool()
        embeds = states[keep][facts._drop_idx:]
        results.append({"prompt_embeds": embeds,
                        "prompt_embeds_mask": torch.ones(embeds.shape[0], dtype=torch.long, device=embeds.device),
                        "image_pad_mask": (ids[keep] == facts._img_token_id)[facts._drop_idx:]})
    return results


def encode_prompt(components: Components, prompt: str, device: str, *, images: list | None = None,
                  max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
    return encode_prompts(components, [prompt], device, images=None if images is None else [images])[0]


def count_prompt_tokens(components: Components, prompt: str, *, max_sequence_length: int | None = None):
    """(text tokens of ``prompt`` after the dropped system message, tokens kept): the pipeline keeps all."""
    facts = _prompt_facts(components["processor"])
    needed = len(components["processor"].tokenizer(_template(facts, prompt, 0)).input_ids) - facts._drop_idx
    return needed, needed


def prompt_lengths(components: Components, prompts: list[str], *, max_sequence_length: int | None = None):
    """Template and text tokens of each prompt (image slots come on top: one per 32x32 pixels)."""
    facts = _prompt_facts(components["processor"])
    return [len(ids) for ids in components["processor"].tokenizer([_template(facts, p, 0) for p in prompts]).input_ids]


def _rgba(pixels: torch.Tensor) -> torch.Tensor:
    """``(B, 3 or 4, F, H, W)`` -> RGBA: an RGB image's alpha is opaque (1 in [-1, 1]), as the pipeline's
    ``convert("RGBA")`` gives it."""
    if pixels.shape[1] == 4:
        return pixels
    return torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)


def encode_pixel_batch(components: Components, pixels: torch.Tensor, device: str) -> list[dict[str, torch.Tensor]]:
    """VAE posterior modes of ``(B, 3 or 4, 1, H, W)``, normalised per channel: each ``(64, 1, H/16, W/16)``."""
    check_pixel_batch(pixels, multiple=PIXEL_MULTIPLE, image_only=True, channels=(3, 4))
    return [{"latents": z} for z in per_channel_normalised_modes(components["vae"], _rgba(pixels), device)]


def encode_pixels(components: Components, pixels: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    check_pixels(pixels, multiple=PIXEL_MULTIPLE, image_only=True, channels=(3, 4))
    return encode_pixel_batch(components, pixels[None], device)[0]


def vae_encode_bytes(frames: int, height: int, width: int) -> int:
    """Peak activation bytes of one bf16 VAE encode: Qwen-Image's measured ~2700 bytes per pixel, its
    first stage being as wide at full resolution (96 channels); an estimate until bench/preprocess.py
    measures this VAE."""
    return 2700 * height * width


def prompt_encode_bytes(tokens: int) -> int:
    """Activation bytes of one bf16 prompt of ``tokens`` through Qwen3-VL-8B (width 4096, MLP 12288, no
    hidden states kept): an estimate scaled from Qwen-Image's measured 400 KB per token, which keeps 29."""
    return 250_000 * tokens


# --- training forward ----------------------------------------------------------------------------

def _layouts(cond: Mapping[str, torch.Tensor], batch: int) -> dict[tuple, list[int]]:
    """Samples by (prompt length, slot layout): one transformer call each."""
    pad = cond["image_pad_mask"].bool()
    mask = cond.get("prompt_embeds_mask")
    lengths = mask.sum(dim=1).tolist() if mask is not None else [pad.shape[1]] * batch
    groups: dict[tuple, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault((length, tuple(pad[i, :length].tolist())), []).append(i)
    return groups


def _check_layout(layout: tuple, references: list[torch.Tensor]) -> None:
    slots, needed = sum(layout), sum(r.shape[-2] * r.shape[-1] // SLOT ** 2 for r in references)
    if slots != needed:
        raise InputError(f"the prompt holds {slots} image slots but its {len(references)} reference latents need "
                         f"{needed}: an entry encoded without its references, or references re-encoded at "
                         f"another size (re-run preprocess)")


def _forward_group(transformer, latents, sigmas, cond, references, length: int) -> torch.Tensor:
    """One transformer call for samples of one slot layout: latents and references ``(b, C, h, w)``."""
    pipe_cls, dtype = _pipeline_cls(), module_dtype(transformer)
    b, c, h, w = latents.shape
    tokens = [pipe_cls._pack_latents(ref.to(dtype), b, ref.shape[1], *ref.shape[-2:]) for ref in references]
    tokens.append(pipe_cls._pack_latents(latents.to(dtype), b, c, h, w))
    shapes = [(1, *ref.shape[-2:]) for ref in references] + [(1, h, w)]
    pad = cond["image_pad_mask"][:, :length].bool()
    img_mask = torch.cat([pad, pad.new_ones(b, h * w // SLOT ** 2)], dim=1)
    out = transformer(hidden_states=torch.cat(tokens, dim=1), timestep=sigmas.to(dtype),
                      encoder_hidden_states=cond["prompt_embeds"][:, :length].to(dtype),
                      encoder_hidden_states_mask=None,
                      img_shapes=[shapes] * b, img_mask=img_mask, return_dict=False)[0]
    return out[:, -h * w:].transpose(1, 2).reshape(b, c, 1, h, w)


def dit_forward(transformer: torch.nn.Module, latents: torch.Tensor, sigmas: torch.Tensor,
                cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Velocity prediction ``(B, 64, 1, h, w)`` of the target; references (``ref_latents_<i>``) condition it."""
    b, _, f, h, w = latents.shape
    if f != 1 or h % SLOT or w % SLOT:
        raise ValueError(f"Qwen-Image-2.1 latents must have one frame and even sides, got {tuple(latents.shape)}")
    references = qwen_image.reference_latents(cond)
    groups = _layouts(cond, b)
    outputs, order = [], []
    for (length, layout), indices in groups.items():
        _check_layout(layout, references)
        index = torch.tensor(indices, device=latents.device) if len(groups) > 1 else slice(None)
        part = {k: v[index] for k, v in cond.items() if isinstance(v, torch.Tensor)}
        refs = [ref[index][:, :, 0] for ref in references]
        outputs.append(_forward_group(transformer, latents[index][:, :, 0], sigmas[index], part, refs, length))
        order += indices
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat(outputs)[torch.argsort(torch.tensor(order, device=latents.device))]


# --- loading -------------------------------------------------------------------------------------

def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str) -> Components:
    plain = tuple(n for n in names if n != "processor")
    out = _load_components(path, plain, dtype, device, allowed=ENCODER_COMPONENTS + ("transformer",))
    if "processor" in names:
        out["processor"] = qwen_vl_processor.load_processor(Path(path) / "processor")
    return {name: out[name] for name in names}


def load_transformer_file(file: Path, config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A single-file DiT: diffusers names (ComfyUI's ``gate_up``, if saved fused, split back)."""
    from diffusers import QwenImage21Transformer2DModel

    return single_file.load_transformer_file(QwenImage21Transformer2DModel, file, config_dir, dtype,
                                             convert=qwen_image21_released.unfused)


def load_encoders(path: Path, dtype: torch.dtype) -> Components:
    """What encoding reads, on the CPU: Qwen3-VL without its LM head, the processor, the VAE without decoder."""
    from transformers import AutoConfig, Qwen3VLModel

    folder = Path(path) / "text_encoder"
    text_encoder = encoders.load_submodel(folder, Qwen3VLModel, AutoConfig.from_pretrained(folder), dtype,
                                          _vl_weight_name)
    return {"text_encoder": text_encoder, "processor": qwen_vl_processor.load_processor(Path(path) / "processor"),
            "vae": encoders.without_decoder(load_component(path, "vae", dtype))}


# --- tiny models and benchmarks -----------------------------------------------------------------

def tiny_processor():
    """Qwen3-VL's processor over the tiny tokenizer: 16-pixel patches merged 2x2 (the release's), images
    from 32x32 pixels up kept at their size (the release keeps 256x256 and up)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                      max_pixels=4096 * 4096, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return qwen_vl_processor.build_processor(tiny_tokenizers.qwen3_vl_tokenizer(), images,
                                             qwen_vl_processor.QWEN3_PROCESSOR_CLASS)


def _vision_token_ids(tokenizer) -> dict[str, int]:
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return dict(zip(names, tokenizer.convert_tokens_to_ids(list(tiny_tokenizers.QWEN_VISION_TOKENS))))


def _tiny_text_encoder(tokenizer):
    """Tiny Qwen3-VL with the release's facts its config is inferred with (qwen_image21_released): 128-wide
    heads with the release's M-RoPE split, 72-wide vision heads, deepstack mergers after vision blocks 8, 16
    and 24 of 25, so that a DiffSynth-style download of it (no config.json) loads as it was saved."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from .qwen_image21_released import TEXT_FACTS, VISION_FACTS

    config = Qwen3VLConfig(
        text_config=dict(TEXT_FACTS, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=128, vocab_size=len(tokenizer)),
        vision_config=dict(VISION_FACTS, depth=25, hidden_size=72, intermediate_size=32, num_heads=1,
                           out_hidden_size=128, patch_size=16, num_position_embeddings=16),
        **_vision_token_ids(tokenizer))
    return Qwen3VLForConditionalGeneration(config)


SCHEDULER_CONFIG = qwen_image.SCHEDULER_CONFIG  # the tiny pipeline's; sampling reads mu from it (validation)


def save_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """A tiny random Qwen-Image-2.1 (about 0.3 M parameters) in the diffusers layout, processor included."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    processor = tiny_processor()
    with MODEL_INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        text_encoder = _tiny_text_encoder(processor.tokenizer)
        vae = AutoencoderKLQwenImage21(**TINY_VAE_CONFIG)
        transformer = QwenImage21Transformer2DModel(**TRANSFORMER_CONFIGS["tiny"])
    pipe = _pipeline_cls()(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae,
                           text_encoder=text_encoder, processor=processor, transformer=transformer)
    # The processor is written by hand (transformers saves a Qwen3VLProcessor only with its torchvision
    # video processor) and named in model_index.json as the release names it.
    pipe.register_modules(processor=None)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir)
    qwen_vl_processor.save_processor(processor, out_dir / "processor", qwen_vl_processor.QWEN3_PROCESSOR_CLASS)
    index = json.loads((out_dir / "model_index.json").read_text())
    index["processor"] = ["transformers", qwen_vl_processor.QWEN3_PROCESSOR_CLASS]
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))
    return out_dir


def build_transformer(variant: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    return build_random_transformer(TRANSFORMER_CLASS, TRANSFORMER_CONFIGS, variant, dtype, device)


def build_encoders(variant: str, dtype: torch.dtype, device: str) -> Components:
    """What ``load_encoders`` returns with random weights in the released layout (benchmarks): Qwen3-VL-8B
    without its LM head, the tiny processor (its ids fit any vocabulary), the VAE without its decoder."""
    from diffusers import AutoencoderKLQwenImage21
    from transformers import Qwen3VLConfig, Qwen3VLModel

    layout = qwen_image21_released.ENCODER_CONFIGS[variant]
    processor = tiny_processor()
    config = Qwen3VLConfig(text_config=layout["text"], vision_config=layout["vision"],
                           **_vision_token_ids(processor.tokenizer))
    text = random_module(lambda: Qwen3VLModel._from_config(config, dtype=dtype), dtype, device)
    vae = random_module(lambda: AutoencoderKLQwenImage21(**layout["vae"]), dtype, device, seed=1)
    return {"text_encoder": text, "processor": processor, "vae": encoders.without_decoder(vae)}


def dummy_inputs(config: Mapping[str, Any], batch: int = 1, height: int = 64, width: int = 64, num_frames: int = 1,
                 text_len: int = 32, seed: int = 0,
                 references: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Random cache-shaped inputs; ``references`` of the target's size add their latents and prompt slots
    (after the first two text tokens, one block each)."""
    check_pixels(torch.empty(3, num_frames, height, width, device="meta"), multiple=PIXEL_MULTIPLE, image_only=True)
    g = torch.Generator().manual_seed(seed)
    shape = (batch, config["in_channels"], 1, height // VAE_SCALE, width // VAE_SCALE)
    latents = random_tensor(shape, g)
    slots = [False, False] + [True] * (references * shape[-2] * shape[-1] // SLOT ** 2)
    pad = torch.tensor(slots + [False] * max(0, text_len - 2), dtype=torch.bool)[None].expand(batch, -1)
    cond = {"prompt_embeds": random_tensor((batch, pad.shape[1], config["context_in_dim"]), g),
            "prompt_embeds_mask": torch.ones(batch, pad.shape[1], dtype=torch.long), "image_pad_mask": pad.clone()}
    for i in range(references):
        cond[f"ref_latents_{i}"] = random_tensor(shape, g)
    return latents, cond


# --- LoRA export ---------------------------------------------------------------------------------

def export_lora(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any],
                out_dir: Path, *, stem: str = "lora") -> dict[str, Path]:
    """diffusers, ComfyUI and DiffSynth files.  DiffSynth's 2.1 DiT has the diffusers module names
    (diffsynth/models/qwen_image_21_dit.py): bare names there.  ComfyUI's fuses ``img_mlp.gate_layer`` and
    ``proj`` into ``gate_up`` at load and maps LoRA keys onto its halves only under the bare and
    ``transformer.`` names (comfy/lora.py, QwenImage branch), not ``diffusion_model.``; diffusers reads a
    file with ``.alpha`` keys as a bare-named one (its Qwen converter adds ``transformer.``).  So ComfyUI
    gets the bare names + ``.alpha``."""
    return lora_export.export_lora_files(
        _pipeline_cls(), peft_state_dict, lora_config, out_dir, stem=stem,
        comfyui_name=str, diffsynth_layout=lora_export.renamed(str))


# DiffSynth's diffsynth/pipelines/qwen_image_21.py (wheel 2.1.12): InputImageEmbedder -> input_latents
# (1, 64, h, w); EditImageEmbedder -> edit_latents, a list of (1, 64, h_i, w_i), on edit rows only;
# PromptEmbedder -> prompt_embeds (1, L, D), edit_image_pad_mask (1, L), and prompt_embeds_mask, None at one
# sample a file (the import fills it with ones, batch_padding's mask).  Same VAE normalisation as ours.
DIFFSYNTH_CACHE_FIELDS = {"input_latents": "latents", "prompt_embeds": "prompt_embeds",
                          "edit_image_pad_mask": "image_pad_mask", "edit_latents": "ref_latents_{i}"}

# DiffSynth's 2.1 LoRA recipe (examples/qwen_image_21/model_training/lora/Qwen-Image-2.1.sh) gives
# --lora_target_modules "": its auto-detection (diffsynth/diffusion/training_module.py) then takes every
# Linear of at least 512 in and out inside the block list, which at the released width is these seven.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out")

SPEC = FamilySpec(
    name="qwen_image21",
    encoder_components=ENCODER_COMPONENTS,
    transformer_component="transformer",
    block_container_names=("transformer_blocks",),
    lora_target_modules=LORA_TARGETS,
    frame_multiple=1,
    load_components=load_components,
    load_transformer_file=load_transformer_file,
    encode_prompt=encode_prompt,
    encode_pixels=encode_pixels,
    dit_forward=dit_forward,
    export_lora=export_lora,
    save_tiny_model=save_tiny_model,
    pipeline_class_name=PIPELINE_CLASS,
    load_encoders=load_encoders,
    encode_prompts=encode_prompts,
    encode_pixel_batch=encode_pixel_batch,
    vae_encode_bytes=vae_encode_bytes,
    prompt_lengths=prompt_lengths,
    prompt_encode_bytes=prompt_encode_bytes,
    count_prompt_tokens=count_prompt_tokens,
    extras={"latent_channels": 64, "vae_scale_factor": VAE_SCALE, "pixel_multiple": PIXEL_MULTIPLE},
    diffsynth_cache_fields=DIFFSYNTH_CACHE_FIELDS,
    transformer_variants=tuple(TRANSFORMER_CONFIGS),
    build_transformer=build_transformer,
    dummy_inputs=dummy_inputs,
    # The image-pad mask runs along the prompt: padded with it (0: no slot) where prompts differ in length.
    batch_padding={"prompt_embeds": "prompt_embeds_mask", "image_pad_mask": "prompt_embeds_mask"},
    diffsynth_template="Qwen-Image",  # DiffSynth's QwenImage21Pipeline trains on FlowMatchScheduler("Qwen-Image")
    default_timestep_sampling="diffsynth",
    default_loss_weighting="diffsynth",
    encoder_variants=tuple(qwen_image21_released.ENCODER_CONFIGS),
    build_encoders=build_encoders,
    released_formats=qwen_image21_released.FORMATS,
    # The pipeline resizes references to about output_resolution² (1024²) at multiples of 32 and hands the
    # same pixels to the VAE (RGBA) and the vision tower (over white).
    references=ReferenceRule(max_count=None, vae_area=REFERENCE_AREA, vae_multiple=PIXEL_MULTIPLE,
                             text_area=REFERENCE_AREA, text_multiple=PIXEL_MULTIPLE, alpha=True, text_at_vae_size=True,
                             empty_prompt_with_references=True),
    vae_rgba=True,
    pixel_multiple=PIXEL_MULTIPLE,
    latent_patch=1,
)
