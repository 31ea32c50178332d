"""Qwen-Image-Edit, Edit-2509 and Edit-2511: the edit variants of ``qwen_image`` (``FamilySpec.variants``).

They share Qwen-Image's DiT, VAE and text encoder architecture; what differs is data:

* the prompt is encoded by Qwen2.5-VL **with the reference images** through the release's
  ``processor`` (diffusers 0.42, pipeline_qwenimage_edit.py / pipeline_qwenimage_edit_plus.py):
  Edit v1's template holds one ``<|vision_start|><|image_pad|><|vision_end|>``, 2509/2511 put
  ``Picture N: ...`` per image before the instruction; both drop the same 64 template tokens.
  A row without references is encoded as Qwen-Image's text-to-image prompt (what DiffSynth-Studio's
  QwenImageUnit_PromptEmbedder does for a row with no ``edit_image``);
* references are VAE-encoded like targets (``encode_pixels``: the posterior mode, normalised per
  channel, as the pipelines' ``_encode_vae_image``) at about 1024² pixels; the vision tower sees
  them at about 384² (2509/2511) or at the VAE's size (Edit v1, whose pipeline passes it the
  same resized image);
* the DiT (``qwen_image.dit_forward``) takes the references' packed tokens after the target's
  with their own ``img_shapes``; Edit-2511's transformer has ``zero_cond_t`` (its references are
  modulated as at t = 0), from its config, a ComfyUI file's ``__index_timestep_zero__`` marker, or
  the variant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from . import encoders, lora_export, qwen_image as qwen, qwen_image_released, qwen_vl_processor, single_file
from . import tiny_tokenizers
from .base import Components, ReferenceRule
from .loading import MODEL_INIT_LOCK, load_component, read_model_index_file
from .loading import load_components as _load_components
from .random_models import random_module, random_tensor
from .released import ReleasedFormat
from .weight_files import read_shapes

TEXT_TO_IMAGE = "qwen-image"  # the variant name of plain Qwen-Image (text-to-image)
ENCODER_COMPONENTS = ("text_encoder", "tokenizer", "processor", "vae")
PIPELINES = {"edit": "QwenImageEditPipeline", "edit-2509": "QwenImageEditPlusPipeline",
             "edit-2511": "QwenImageEditPlusPipeline"}
# The releases' repository names (DiffSynth-Studio keeps its downloads under them) -> variant.
RELEASE_NAMES = {"qwen-image": TEXT_TO_IMAGE, "qwen-image-2512": TEXT_TO_IMAGE, "qwen-image-edit": "edit",
                 "qwen-image-edit-2509": "edit-2509", "qwen-image-edit-2511": "edit-2511"}
# ComfyUI's flag tensor in Edit-2511 single files (comfy/ldm/qwen_image/model.py: default_ref_method
# "index_timestep_zero"): no weight, just the marker.
ZERO_COND_T_MARKER = "__index_timestep_zero__"
# diffusers' pipeline_qwenimage_edit_plus.py, _get_qwen_prompt_embeds: one per reference image.
PICTURE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
VAE_AREA = 1024 * 1024       # VAE_IMAGE_SIZE of the edit pipelines
CONDITION_AREA = 384 * 384   # CONDITION_IMAGE_SIZE of the Plus pipeline (2509/2511)


def pipeline_cls(variant: str):
    import diffusers

    return getattr(diffusers, PIPELINES[variant])


def _template(pipeline) -> tuple[str, int]:
    """(prompt template, template tokens dropped) of a pipeline class, read from an instance without models."""
    kwargs = dict(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    if "processor" in pipeline.__init__.__code__.co_varnames:
        kwargs["processor"] = None
    pipe = pipeline(**kwargs)
    return pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx


# --- prompts ---------------------------------------------------------------------------------

def _prompt_texts(variant: str, prompts: list[str], images: list[list] | None) -> tuple[list[str], list[int]]:
    """Each prompt in its template, and the template tokens its encoding drops."""
    t2i_template, t2i_drop = _template(qwen._pipeline_cls())
    edit_template, edit_drop = _template(pipeline_cls(variant))
    texts, drops = [], []
    for i, prompt in enumerate(prompts):
        count = len(images[i]) if images is not None else 0
        if count == 0:
            texts.append(t2i_template.format(prompt))
            drops.append(t2i_drop)
        elif variant == "edit":
            if count > 1:
                raise ValueError(f"Qwen-Image-Edit takes one reference image per prompt, got {count}")
            texts.append(edit_template.format(prompt))
            drops.append(edit_drop)
        else:
            pictures = "".join(PICTURE_PROMPT.format(k + 1) for k in range(count))
            texts.append(edit_template.format(pictures + prompt))
            drops.append(edit_drop)
    return texts, drops


def encode_prompts_for(variant: str):
    def encode_prompts(components: Components, prompts: list[str], device: str, *, images: list[list] | None = None,
                       max_sequence_length: int | None = None) -> list[dict[str, torch.Tensor]]:
        """The edit pipeline's ``encode_prompt(prompt, image=...)`` for a batch (one image list per prompt),
        right-padded and cut back to each prompt's length.  The edit pipelines do not truncate
        (their ``max_sequence_length`` is unused), so neither does this."""
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
        texts, drops = _prompt_texts(variant, list(prompts), images)
        flat = [image for row in (images or []) for image in row]
        inputs = components["processor"](text=texts, images=flat or None, padding=True, return_tensors="pt")
        inputs = inputs.to(torch.device(device))
        with torch.no_grad():
            out = components["text_encoder"](input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                              pixel_values=inputs.get("pixel_values"),
                                              image_grid_thw=inputs.get("image_grid_thw"), output_hidden_states=True)
        hidden = out.hidden_states[-1]
        results = []
        for i, drop in enumerate(drops):
            embeds = hidden[i][inputs["attention_mask"][i].bool()][drop:]
            results.append({"prompt_embeds": embeds,
                            "prompt_embeds_mask": torch.ones(embeds.shape[0], dtype=torch.long, device=embeds.device)})
        return results

    return encode_prompts


def encode_prompt_for(variant: str):
    encode_prompts = encode_prompts_for(variant)

    def encode_prompt(components: Components, prompt: str, device: str, *, images: list | None = None,
                      max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
        return encode_prompts(components, [prompt], device, images=None if images is None else [images])[0]

    return encode_prompt


def count_prompt_tokens_for(variant: str):
    def count_prompt_tokens(components: Components, prompt: str, *, max_sequence_length: int | None = None):
        """(text tokens of ``prompt`` after the template prefix, tokens kept): the edit pipelines keep all."""
        [text], [drop] = _prompt_texts(variant, [prompt], [[None]])
        needed = len(components["processor"].tokenizer(text).input_ids) - drop
        return needed, needed

    return count_prompt_tokens


def prompt_lengths_for(variant: str):
    def prompt_lengths(components: Components, prompts: list[str], *, max_sequence_length: int | None = None):
        """Template and text tokens of each prompt (the images' tokens come on top: about 190 per 384² image)."""
        texts, _ = _prompt_texts(variant, list(prompts), None)
        return [len(ids) for ids in components["processor"].tokenizer(texts).input_ids]

    return prompt_lengths


# --- loading ---------------------------------------------------------------------------------

def _vl_weight_name(key: str) -> str | None:
    """Checkpoint key of Qwen2.5-VL -> name in ``Qwen2_5_VLModel`` (vision tower and text decoder, no LM
    head); both spellings (``model.layers``/``visual`` before transformers 4.52, ``model.language_model``/
    ``model.visual`` after)."""
    for prefix, name in (("model.visual.", "visual."), ("visual.", "visual."),
                         ("model.language_model.", "language_model."), ("model.", "language_model.")):
        if key.startswith(prefix):
            return name + key[len(prefix):]
    return None  # lm_head.*


def load_encoders(path: Path, dtype: torch.dtype) -> Components:
    """What VL encoding reads, on the CPU: Qwen2.5-VL with its vision tower (no LM head), the
    tokenizer, the processor and the VAE without its decoder."""
    from transformers import AutoConfig, Qwen2_5_VLModel

    folder = Path(path) / "text_encoder"
    text_encoder = encoders.load_submodel(folder, Qwen2_5_VLModel, AutoConfig.from_pretrained(folder), dtype,
                                          _vl_weight_name)
    return {"text_encoder": text_encoder, "tokenizer": load_component(path, "tokenizer", dtype),
            "processor": qwen_vl_processor.load_processor(Path(path) / "processor"),
            "vae": encoders.without_decoder(load_component(path, "vae", dtype))}


def set_zero_cond_t(transformer: torch.nn.Module, on: bool) -> torch.nn.Module:
    """Turn Edit-2511's reference modulation on or off: a flag of the model and each block, no weights
    (QwenImageTransformer2DModel reads ``self.zero_cond_t`` in its forward)."""
    on = bool(on)
    transformer.zero_cond_t = on
    for block in transformer.transformer_blocks:
        block.zero_cond_t = on
    transformer.register_to_config(zero_cond_t=on)
    return transformer


def load_components_for(variant: str):
    zero_cond_t = variant == "edit-2511"

    def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str) -> Components:
        plain = tuple(n for n in names if n != "processor")
        out = _load_components(path, plain, dtype, device, allowed=ENCODER_COMPONENTS + ("transformer",))
        if "processor" in names:
            out["processor"] = qwen_vl_processor.load_processor(Path(path) / "processor")
        if zero_cond_t and "transformer" in out:
            set_zero_cond_t(out["transformer"], True)
        return {name: out[name] for name in names}

    return load_components


def _without_marker(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != ZERO_COND_T_MARKER}


def load_transformer_file_for(variant: str):
    def load_transformer_file(file: Path, config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
        """A single-file DiT (ComfyUI keys are diffusers names; Edit-2511's marker is dropped)."""
        from diffusers import QwenImageTransformer2DModel

        model = single_file.load_transformer_file(QwenImageTransformer2DModel, file, config_dir, dtype,
                                                  convert=_without_marker)
        return set_zero_cond_t(model, True) if variant == "edit-2511" else model

    return load_transformer_file


def _released_2511_transformer(fmt: ReleasedFormat) -> ReleasedFormat:
    return ReleasedFormat(fmt.component, fmt.library, fmt.class_name, "Qwen-Image-Edit-2511 transformer weights",
                          fmt.recognise, lambda s: {**fmt.infer_config(s), "zero_cond_t": True},
                          convert=_without_marker)


# Edit-2511's DiT as released: the Qwen-Image layout plus zero_cond_t (DiffSynth downloads no config.json).
FORMATS_2511 = tuple(_released_2511_transformer(f) if f.component == "transformer" else f
                     for f in qwen_image_released.FORMATS)


# --- telling the variants apart ------------------------------------------------------------------

def _config_says_zero_cond_t(folder: Path) -> bool | None:
    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        return bool(json.loads(config.read_text()).get("zero_cond_t", False))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None


def _has_marker(files: list[Path]) -> bool:
    weights = [f for f in files if f.suffix == ".safetensors"]
    return bool(weights) and ZERO_COND_T_MARKER in read_shapes(weights, strip=True)


def _from_names(path: Path) -> str | None:
    """A release's repository name among the path's folders (DiffSynth's layout), else a file name
    that names its version ("qwen_image_edit_2509_fp8.safetensors"); None: the names do not tell."""
    for part in reversed(path.parts):
        if part.lower() in RELEASE_NAMES:
            return RELEASE_NAMES[part.lower()]
    name = path.name.lower().replace("-", "_")
    if "edit" not in name:
        return TEXT_TO_IMAGE  # what these files always were before the edit variants came
    for version in ("2511", "2509"):
        if version in name:
            return f"edit-{version}"
    return None  # Edit v1 and a renamed 2509 file cannot be told apart


def variant_of(path: Path | None) -> str | None:
    """The variant a model folder, transformer folder or single DiT file is, or None where the files
    cannot tell (Edit v1 and 2509 share an architecture and their single files are alike) or there are none."""
    if path is None:
        return None
    path = Path(path)
    if (path / "model_index.json").is_file():
        pipeline = read_model_index_file(path).get("_class_name")
        if pipeline == "QwenImageEditPipeline":
            return "edit"
        if pipeline == "QwenImageEditPlusPipeline":
            return "edit-2511" if _config_says_zero_cond_t(path / "transformer") else "edit-2509"
        return TEXT_TO_IMAGE  # QwenImagePipeline; another family's folder is refused by check_model_folder
    files = sorted(p for p in path.rglob("*.safetensors")) if path.is_dir() else [path]
    folder = path if path.is_dir() else path.parent
    if _config_says_zero_cond_t(folder) or (path.exists() and _has_marker(files[:1] if path.is_file() else files)):
        return "edit-2511"
    return _from_names(path)


# --- tiny models and benchmarks ------------------------------------------------------------------

def _tiny_processor():
    return qwen_vl_processor.build_processor(tiny_tokenizers.qwen2_vl_tokenizer())


def save_tiny_model_for(variant: str):
    def save_tiny_model(out_dir: Path, seed: int = 0) -> Path:
        """A tiny random edit model (Qwen2.5-VL with its vision tower, the processor) in the variant's
        diffusers layout."""
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

        processor = _tiny_processor()
        tokenizer = processor.tokenizer
        ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                       tokenizer.convert_tokens_to_ids(list(tiny_tokenizers.QWEN_VISION_TOKENS))))
        with MODEL_INIT_LOCK, torch.random.fork_rng():
            torch.manual_seed(seed)
            text_encoder = qwen._tiny_text_encoder(len(tokenizer), tokenizer.eos_token_id, token_ids=ids)
            vae = AutoencoderKLQwenImage(**qwen.TINY_VAE_CONFIG)
            transformer = QwenImageTransformer2DModel(**qwen.TRANSFORMER_CONFIGS["tiny"],
                                                      zero_cond_t=variant == "edit-2511")
        # The processor is written by hand (transformers saves a Qwen2VLProcessor only with its
        # torchvision video processor) and named in model_index.json as the releases name it.
        pipe = pipeline_cls(variant)(scheduler=FlowMatchEulerDiscreteScheduler(**qwen.SCHEDULER_CONFIG), vae=vae,
                                     text_encoder=text_encoder, tokenizer=tokenizer, processor=None,
                                     transformer=transformer)
        out_dir = Path(out_dir)
        pipe.save_pretrained(out_dir)
        qwen_vl_processor.save_processor(processor, out_dir / "processor")
        index = json.loads((out_dir / "model_index.json").read_text())
        index["processor"] = ["transformers", qwen_vl_processor.PROCESSOR_CLASS]
        (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))
        return out_dir

    return save_tiny_model


# Released layout of the vision tower (Qwen2.5-VL-7B's, 0.67 B parameters), for build_encoders.
VISION_CONFIG = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                     fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")


def build_encoders(variant: str, dtype: torch.dtype, device: str) -> Components:
    """What the edit variants' ``load_encoders`` returns with random weights in the released layout
    (benchmarks): Qwen2.5-VL-7B with its vision tower, the tiny processor (its ids fit any vocabulary)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    layout = qwen.ENCODER_CONFIGS[variant]
    processor = _tiny_processor()
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   processor.tokenizer.convert_tokens_to_ids(list(tiny_tokenizers.QWEN_VISION_TOKENS))))
    config = Qwen2_5_VLConfig(text_config=layout["text"], vision_config=VISION_CONFIG, **ids)
    text = random_module(lambda: Qwen2_5_VLModel._from_config(config, dtype=dtype), dtype, device)
    vae = random_module(lambda: AutoencoderKLQwenImage(**layout["vae"]), dtype, device, seed=1)
    return {"text_encoder": text, "tokenizer": processor.tokenizer, "processor": processor,
            "vae": encoders.without_decoder(vae)}


def dummy_inputs(config: Mapping[str, Any], batch: int = 1, height: int = 64, width: int = 64, num_frames: int = 1,
                 text_len: int = 32, seed: int = 0, references: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``qwen_image.dummy_inputs`` plus ``references`` reference latents of the target's size."""
    latents, cond = qwen.dummy_inputs(config, batch, height, width, num_frames, text_len, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(references):
        cond[f"ref_latents_{i}"] = random_tensor(tuple(latents.shape), g)
    return latents, cond


# --- LoRA export -----------------------------------------------------------------------------------

def export_lora_for(variant: str):
    def export_lora(peft_state_dict: dict[str, torch.Tensor], lora_config: dict[str, Any], out_dir: Path, *,
                    stem: str = "lora") -> dict[str, Path]:
        """Qwen-Image's files (the edit DiT has its module names), written for the edit pipeline."""
        return lora_export.export_lora_files(
            pipeline_cls(variant), peft_state_dict, lora_config, out_dir, stem=stem,
            comfyui_name=lambda module: "diffusion_model." + module, diffsynth_layout=lora_export.renamed(str))

    return export_lora


def variant_fields(variant: str) -> dict[str, Any]:
    """The FamilySpec fields ``variant`` replaces on Qwen-Image's spec."""
    if variant == TEXT_TO_IMAGE:
        return {}
    one = variant == "edit"
    return dict(
        references=ReferenceRule(max_count=1 if one else None, vae_area=VAE_AREA, vae_multiple=32,
                                 text_area=VAE_AREA if one else CONDITION_AREA, text_multiple=32),
        encoder_components=ENCODER_COMPONENTS,
        pipeline_class_name=PIPELINES[variant],
        load_components=load_components_for(variant),
        load_transformer_file=load_transformer_file_for(variant),
        load_encoders=load_encoders,
        encode_prompt=encode_prompt_for(variant),
        encode_prompts=encode_prompts_for(variant),
        count_prompt_tokens=count_prompt_tokens_for(variant),
        prompt_lengths=prompt_lengths_for(variant),
        save_tiny_model=save_tiny_model_for(variant),
        export_lora=export_lora_for(variant),
        build_encoders=build_encoders,
        dummy_inputs=dummy_inputs,
        released_formats=FORMATS_2511 if variant == "edit-2511" else qwen_image_released.FORMATS,
    )


VARIANTS = {name: variant_fields(name) for name in (TEXT_TO_IMAGE, "edit", "edit-2509", "edit-2511")}
