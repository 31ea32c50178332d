"""The one interface every model family implements.

A family is a module (``qwen_image.py``, ``flux.py``, ``wan.py``) that builds a frozen
:class:`FamilySpec`.  Engines (preprocess, training, offload, LoRA) only ever talk to a
family through this spec, so no code outside ``models/`` branches on the family name.

Tensor conventions shared by every family (batch size 1 inside the cache):

* ``encode_prompt`` returns the prompt-side cache entries, e.g. ``{"prompt_embeds": (L, D)}``
  without the batch dimension (no gradients; what the family pipeline's ``encode_prompt`` gives).
  It takes a keyword-only ``max_sequence_length``.  Entries whose length differs between prompts
  are named in ``batch_padding`` (Qwen-Image's ``prompt_embeds`` -> ``prompt_embeds_mask``): a
  batch zero-pads them and their mask on dim 0; every other entry is stacked as it is.
* ``encode_pixels`` takes pixels ``(3, F, H, W)`` in ``[-1, 1]`` (``F == 1`` for images,
  ``F = frame_multiple*k + 1`` for video) and returns ``{"latents": (C, f, h, w)}`` -- always 4-D,
  images too (``f == 1``) -- the VAE posterior mode, normalised the family's way, no batch dim.
* ``encode_prompts`` / ``encode_pixel_batch`` are the batched forms stage 1 uses: a list of
  prompts, or pixels ``(B, 3, F, H, W)`` of one shape, give one dict per sample, shaped as the
  one-at-a-time functions give them (which are these with a batch of one).  Values equal
  one-at-a-time encoding up to the kernels' batch dependence (padding, algorithm choice).
* ``dit_forward`` takes batched latents ``(B, C, f, h, w)`` and sigmas ``(B,)`` in ``[0, 1]`` plus
  the batched prompt-side tensors, and returns the flow-matching velocity prediction (target
  ``noise - x0``) in the latents' layout, in the transformer's dtype (packing/unpacking and
  timestep scaling are its job).

Reference inputs, variants and experts are data on the spec (docs/design.md, "Conditioning"):

* ``references`` (a :class:`ReferenceRule`, None: the family takes no reference images) says how
  many images a row may give besides its target (edit references, an I2V first frame) and how
  each is resized.  The dataset reads them from every column convention into one ordered list per
  row; stage 1 VAE-encodes each at its own size into the cache entries ``ref_latents_0``,
  ``ref_latents_1``, ... (``(C, f, h, w)`` like ``latents``; ``encode_references`` where a
  family conditions on more than the latents) and passes them, resized for the vision tower, to
  ``encode_prompts(..., images=[[PIL.Image, ...] per prompt])`` when ``text_area`` is set.
  ``dit_forward`` finds ``ref_latents_<i>`` in ``cond``; the loss covers the target alone.
* ``variants`` maps a variant name (``"edit-2509"``, ``"klein-4b"``, ``"ti2v-5b"``) to the spec
  fields it replaces; ``variant_of(path)`` tells a variant from the files (None: cannot tell).
  ``models.get_family(name, variant)`` returns the spec with them applied, ``variant`` set.
* ``experts`` (Wan2.2 A14B): the trainable transformers in routing order, each serving the sigmas
  in its ``[sigma_min, sigma_max]``; empty: one transformer, ``transformer_component``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

# A loaded model folder: component name -> object ("transformer", "vae", "text_encoder",
# "tokenizer", ...).  Plain dict so families can hold whatever their pipeline needs.
Components = dict[str, Any]


@dataclass(frozen=True)
class ReferenceRule:
    """The images a family conditions on besides its prompt and target, and how each is resized.

    Sizes follow the reference pipelines (diffusers' ``calculate_dimensions``): an image of aspect
    ``w/h`` is resized to about ``area`` pixels, each side a multiple of ``multiple``.
    """

    # How many one row may give (None: any number); rows giving none train as text-to-image
    # unless ``required`` (I2V).
    max_count: int | None = None
    required: bool = False
    # The VAE's input: about ``vae_area`` pixels (None: the image's own size, floored to the
    # multiple); ``match_target``: resized and cropped to the target's size instead (I2V).
    vae_area: int | None = 1024 * 1024
    vae_multiple: int = 32
    match_target: bool = False
    # At ``vae_area``: cover the size and centre-crop (DiffSynth's FLUX.2 ``edit_image_auto_resize``) rather
    # than stretch to it (the edit pipelines' resize).
    vae_crop: bool = False
    # The text encoder's vision tower: about ``text_area`` pixels; None: the prompt takes no images.
    text_area: int | None = None
    text_multiple: int = 32
    # RGBA to the VAE (opaque alpha for RGB files); the vision tower gets RGB over white.
    alpha: bool = False
    # The vision tower sees each reference as the VAE does (its size and crop, alpha over white), not at
    # ``text_area``: Qwen-Image-2.1, whose every image slot in the prompt stands for 2x2 of its latents.
    text_at_vae_size: bool = False
    # The prompt embedding is valid only with the row's references in it (its image slots must match their
    # latents: Qwen-Image-2.1): caption dropout trains on the empty text encoded with the row's references,
    # one cache entry per such row, not on the one text-only empty prompt.  Changes no decoded pixels: not keyed.
    empty_prompt_with_references: bool = False
    # A video target's first frame is the reference when the row names none (I2V).
    first_frame_of_target: bool = False


@dataclass(frozen=True)
class Expert:
    """One of several trainable transformers (Wan2.2 A14B): the component and the sigmas it serves."""

    component: str
    sigma_min: float
    sigma_max: float
    # What its LoRA files are called (``lora_<label>.safetensors``); empty: the component's name.
    label: str = ""


@dataclass(frozen=True)
class FamilySpec:
    name: str
    # Components that only stage 1 needs (no gradients) and the one stage 2 trains.
    encoder_components: tuple[str, ...]
    transformer_component: str
    # Attribute names of the DiT's nn.ModuleLists of blocks (offload and checkpointing read these).
    block_container_names: tuple[str, ...]
    # Default LoRA targets, matched as module-name suffixes.
    lora_target_modules: tuple[str, ...]
    # Video families need 4k+1 frames; image families use 1.
    frame_multiple: int
    # --- behaviour -------------------------------------------------------------------------
    # load_components(path, names, dtype, device) -> Components
    load_components: Callable[[Path, tuple[str, ...], torch.dtype, str], Components]
    # load_transformer_file(file, config_dir, dtype) -> nn.Module : a single .safetensors DiT
    load_transformer_file: Callable[[Path, Path, torch.dtype], torch.nn.Module]
    # encode_prompt(components, prompt, device) -> dict[str, Tensor]
    encode_prompt: Callable[[Components, str, str], dict[str, torch.Tensor]]
    # encode_pixels(components, pixels, device) -> {"latents": Tensor}
    encode_pixels: Callable[[Components, torch.Tensor, str], dict[str, torch.Tensor]]
    # dit_forward(transformer, latents, sigmas, cond) -> prediction in the latents' layout
    dit_forward: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
    # export_lora(peft_state_dict, lora_config, out_dir, *, stem="lora") -> {"diffusers": path,
    # "comfyui": path, "diffsynth": path}: one file per consumer (models/lora_export.py)
    export_lora: Callable[..., dict[str, Path]]
    # save_tiny_model(out_dir, seed) -> out_dir : a tiny random model in the diffusers layout
    save_tiny_model: Callable[[Path, int], Path]
    # Name of the diffusers pipeline class that loads the folder (validation, reload tests).
    pipeline_class_name: str
    # --- stage 1, batched (optional: stage 1 falls back to load_components and the functions above)
    # load_encoders(path, dtype) -> Components : only what encoding reads, on the CPU (no LM head,
    # vision tower or VAE decoder)
    load_encoders: Callable[[Path, torch.dtype], Components] | None = None
    # encode_prompts(components, prompts, device, *, max_sequence_length) -> [encode_prompt result, ...]
    encode_prompts: Callable[..., list[dict[str, torch.Tensor]]] | None = None
    # encode_pixel_batch(components, pixels (B, 3, F, H, W), device) -> [encode_pixels result, ...]
    encode_pixel_batch: Callable[[Components, torch.Tensor, str], list[dict[str, torch.Tensor]]] | None = None
    # vae_encode_bytes(frames, height, width) -> peak activation bytes of one bf16 VAE encode
    vae_encode_bytes: Callable[[int, int, int], int] | None = None
    # prompt_lengths(components, prompts, max_sequence_length) -> tokens each prompt takes in a batch
    prompt_lengths: Callable[..., list[int]] | None = None
    # prompt_encode_bytes(tokens) -> activation bytes one bf16 prompt padded to ``tokens`` adds to a batch
    prompt_encode_bytes: Callable[[int], int] | None = None
    # count_prompt_tokens(components, prompt, *, max_sequence_length) -> (tokens the prompt needs,
    # tokens encode_prompt keeps): longer prompts are truncated, and preprocessing reports them.
    count_prompt_tokens: Callable[..., tuple[int, int]] | None = None
    # Extra, family-specific notes (e.g. default guidance); never read by engines.
    extras: Mapping[str, Any] = field(default_factory=dict)
    # DiffSynth-Studio's cached pipeline inputs -> our cache entry names (``splitflow cache import``):
    # what its ``sft:data_process`` task pickles for this family, read from its pipeline units.  A name
    # with ``{i}`` takes a list, one field per item (``"ref_latents_{i}"``: an edit row's references).
    diffsynth_cache_fields: Mapping[str, str] = field(default_factory=dict)
    # --- without weights: benchmarks and tests -------------------------------------------------
    # DiT layouts build_transformer knows: "tiny" plus released ones ("Qwen-Image", "FLUX.1-dev", ...).
    transformer_variants: tuple[str, ...] = ()
    # build_transformer(variant, dtype, device) -> the DiT with random N(0, 0.02) weights, made on device
    build_transformer: Callable[[str, torch.dtype, str], torch.nn.Module] | None = None
    # dummy_inputs(transformer_config, batch, height, width, num_frames, text_len, seed) -> (latents, cond):
    # random fp32 CPU tensors shaped like batched cache entries for pixels of that size
    dummy_inputs: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None
    # --- training: batches and schedule (docs/training.md) -----------------------------------------
    # Prompt-side entry -> its mask entry, for entries whose length (dim 0) differs between prompts:
    # a batch zero-pads both (mask 0 = padding).  Fixed-length text encoders (T5 padded to its max
    # length) declare none: their entries stack as they are.
    batch_padding: Mapping[str, str] = field(default_factory=dict)
    # DiffSynth-Studio FlowMatchScheduler template whose training schedule "diffsynth" means here
    # ("FLUX.1", "Wan", "Qwen-Image"); None: the family has no DiffSynth schedule.
    diffsynth_template: str | None = None
    # What train.timestep_sampling / train.loss_weighting = "auto" resolve to for this family.
    default_timestep_sampling: str = "uniform"
    default_loss_weighting: str = "none"
    # Encoder layouts build_encoders knows (released ones: "Qwen-Image", "FLUX.1-dev", "Wan2.1").
    encoder_variants: tuple[str, ...] = ()
    # build_encoders(variant, dtype, device) -> what load_encoders returns, with random weights (benchmarks)
    build_encoders: Callable[[str, torch.dtype, str], Components] | None = None
    # --- files as released (models/released.py) ---------------------------------------------------
    # How each component is stored in released files (recognised from keys; config from shapes).
    released_formats: tuple = ()
    # DiffSynth-Studio's module names for LoRA targets -> diffusers target patterns (``*`` = one segment).
    lora_target_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # native_module_name(name) -> the diffusers name of a DiT module named as in the original
    # release (LoRA files with native keys), or None; None where the release uses diffusers names.
    native_module_name: Callable[[str], str | None] | None = None
    # --- conditioning, variants, experts (module docstring) -----------------------------------------
    references: ReferenceRule | None = None
    # encode_references(components, pixels [(3 or 4, 1, H, W), ...], device, *, target_shape) ->
    # {"ref_latents_0": ..., ...}; None: each reference is ``encode_pixels``' latents.
    encode_references: Callable[..., dict[str, torch.Tensor]] | None = None
    # variant name -> the FamilySpec fields it replaces; ``variant`` names the one applied.
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    variant: str | None = None
    # variant_of(model_path or None: no folder) -> the variant the files are, or None where they cannot tell
    variant_of: Callable[[Path], str | None] | None = None
    # encoders_variant(model.sources) -> the variant the encoders' files alone tell (a split run's first
    # stage names no DiT), or None: asked when nothing else tells
    encoders_variant: Callable[[Mapping[str, list[str]]], str | None] | None = None
    # What prompt entries depend on among variants (the template and text encoder kind): variants that encode
    # prompts alike share their cache entries; None: the variant's name
    prompt_template: str | None = None
    experts: tuple[Expert, ...] = ()
    # The VAE takes RGBA (Qwen-Image-2.1): targets keep their alpha, RGB files get an opaque one, and
    # ``encode_pixels`` takes (4, F, H, W); references follow ``ReferenceRule.alpha``.
    vae_rgba: bool = False
    # Targets are cropped to multiples of this many pixels: the VAE's down-sampling times the DiT's patch
    # (16 for the 8x VAEs with 2x2 patches; Qwen-Image-2.1: 16x VAE, its prompt slots 2x2 latents).
    pixel_multiple: int = 16
    # Latent positions per DiT token side: tokens = frames x h x w / latent_patch² (2x2 patches; Qwen-Image-2.1
    # takes its latents unpatched).  Resolution-dependent shifts and activation plans count tokens with it.
    latent_patch: int = 2
    # ``model.<key>`` settings the family applies to its loaded transformer, key -> apply(transformer,
    # value) -> transformer (Edit-2511's ``zero_cond_t``); an unset (None) key leaves it as loaded.
    transformer_options: Mapping[str, Callable[[torch.nn.Module, Any], torch.nn.Module]] = field(default_factory=dict)
