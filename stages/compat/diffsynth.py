"""DiffSynth-Studio command lines -> a ``RunConfig``, so its example scripts run with
``accelerate launch examples/<family>/model_training/train.py`` replaced by ``splitflow run``.

The flags are those of diffsynth/diffusion/parsers.py plus each family's train.py
(examples/{qwen_image,flux,wanvideo}/model_training/train.py).  Every flag is mapped onto the
config, accepted as a no-op with one notice line, or refused; unknown and refused flags are all
reported in one line, before any model or server starts.  Without a CONFIG file DiffSynth's own
defaults hold for absent flags (``lora_rank`` 32, ``output_path`` ./models, Wan's ``num_frames``
81 ...); with one, the file's values do.  docs/diffsynth.md has the table.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, RunConfig, apply_override, build_config, read_config_file

# The model registry, the recognisers and torch are imported only when a config is built, so
# splitting argv (every CLI call, --help included) stays as cheap as parsing it.


@dataclass(frozen=True)
class Flag:
    kind: str = "value"       # "value" (takes one argument), "switch" (store_true) or "list" (comma-separated)
    key: str | None = None    # the RunConfig key it sets; None: handled by name below
    default: Any = None       # DiffSynth's default, holding without a CONFIG file when the flag is absent
    noop: str = ""            # why it changes nothing here (one notice line)
    refuse: str = ""          # why splitflow cannot honour it (an error unless given its default)


_IMAGE_ONLY = "splitflow trains the DiT of text-to-image/video families from cached prompts and pixels"
_DMD2 = ("student_update_freq", "student_sample_steps", "student_sample_type", "student_schedule", "student_t_list",
         "matching_t_min", "matching_t_max", "matching_t_sampling", "matching_t_mean", "matching_t_std",
         "gan_loss_weight", "gan_r1_reg_weight", "gan_r1_reg_alpha", "fake_score_learning_rate",
         "discriminator_learning_rate", "feature_indices", "teacher_cfg_scale", "student_grad_clip_norm")

FLAGS: dict[str, Flag] = {
    # dataset (parsers.py add_dataset_base_config, add_image_size_config, add_video_size_config)
    "dataset_base_path": Flag(key="dataset.base_path"),
    "dataset_metadata_path": Flag(key="dataset.metadata_path"),
    "dataset_repeat": Flag(key="dataset.repeat", default=1),
    "dataset_num_workers": Flag(noop="images and videos are decoded once, in preprocess (preprocess.parts splits that work)"),
    "data_file_keys": Flag("list", "dataset.data_file_keys", default="image,video"),
    "height": Flag(key="dataset.height"),
    "width": Flag(key="dataset.width"),
    "max_pixels": Flag(key="dataset.max_pixels", default=1024 * 1024),
    "num_frames": Flag(key="dataset.num_frames"),  # 81 for video families (add_video_size_config)
    # models (add_model_config; tokenizer flags from each train.py)
    "model_paths": Flag(),
    "model_id_with_origin_paths": Flag(),
    "tokenizer_path": Flag(), "tokenizer_1_path": Flag(), "tokenizer_2_path": Flag(),
    "processor_path": Flag(),  # the processor of a model whose prompts see images (models.add_tokenizers)
    "audio_processor_path": Flag(noop="Wan2.2-S2V's audio processor; text-to-video training does not use it"),
    # Pipeline inputs read from a row: the reference columns (the dataset reads them as each row's reference
    # images whenever the model takes references) and those EXTRA_INPUTS names; others refused (_check_extra_inputs).
    "extra_inputs": Flag("list"),
    "fp8_models": Flag(refuse="FP8 weights are not supported; use offload.storage_dtype or enable_model_cpu_offload"),
    "offload_models": Flag(noop="preprocess streams the encoders from host memory by itself "
                                "(preprocess.offload_encoders, auto on a GPU)"),
    "resume_from_checkpoint": Flag(refuse="splitflow resumes from output_path/checkpoints by itself; to continue "
                                          "a LoRA file use --lora_checkpoint"),
    "quant_options": Flag(refuse="dynamic quantization is not supported"),
    "initialize_model_on_cpu": Flag("switch", noop="models are always built on the CPU, then placed"),
    "zero_cond_t": Flag("switch", "model.zero_cond_t"),  # Qwen-Image-Edit-2511; absent: the transformer's config
    "framewise_decoding": Flag("switch", default=False, refuse="WanToDance's framewise decoding is not supported"),
    # one Wan2.2 A14B expert per run: the schedule's index fractions -> train.sigma_range (below)
    "max_timestep_boundary": Flag(), "min_timestep_boundary": Flag(),
    # training (add_training_config, add_gradient_config)
    "learning_rate": Flag(key="train.learning_rate", default=1e-4),
    "num_epochs": Flag(key="train.num_epochs", default=1),
    "trainable_models": Flag("list"),
    "find_unused_parameters": Flag("switch", noop="gradients are averaged over the trainable parameters only"),
    "weight_decay": Flag(key="train.weight_decay", default=0.01),
    "task": Flag(default="sft"),
    "customized_optimizer": Flag(key="train.optimizer"),
    "use_gradient_checkpointing": Flag("switch", "train.gradient_checkpointing", default=False),
    "use_gradient_checkpointing_offload": Flag("switch", "train.gradient_checkpointing_offload", default=False),
    "gradient_accumulation_steps": Flag(key="train.gradient_accumulation_steps", default=1),
    # output (add_output_config)
    "output_path": Flag(key="output.path", default="./models"),
    "remove_prefix_in_ckpt": Flag(noop="the LoRA files use fixed key formats, one per consumer (README)"),
    "save_steps": Flag(key="train.save_steps"),
    "align_to_opensource_format": Flag("switch", noop="LoRA files for ComfyUI and diffusers are written anyway "
                                                      "(README: which file for which tool)"),
    # LoRA (add_lora_config)
    "lora_base_model": Flag(),
    "lora_target_modules": Flag("list", "train.lora_target_modules", default="q,k,v,o,ffn.0,ffn.2"),  # translated below
    "lora_rank": Flag(key="train.lora_rank", default=32),
    "lora_checkpoint": Flag(key="train.lora_checkpoint"),
    "preset_lora_path": Flag(key="train.preset_lora_path"),
    "preset_lora_model": Flag(default="dit", refuse="a preset LoRA can only be fused into the DiT (dit)"),
    # template models (add_template_model_config)
    "template_model_id_or_path": Flag(refuse="template models are not supported"),
    "enable_lora_hot_loading": Flag("switch", default=False, refuse="LoRA hot-loading is not supported"),
    # offload (add_offload_training_config)
    "enable_model_cpu_offload": Flag("switch", "offload.enable_model_cpu_offload", default=False),
    "enable_optimizer_cpu_offload": Flag("switch", "offload.enable_optimizer_cpu_offload", default=False),
    "cpu_offload_split_threshold": Flag(key="offload.cpu_offload_split_threshold"),
    # logging (add_logger_config)
    "enable_tensorboard_log": Flag("switch", "train.tensorboard", default=False),
    "enable_csv_log": Flag("switch", noop="metrics.csv is always written"),
    "enable_swanlab_log": Flag("switch", default=False, refuse="SwanLab logging is not supported (metrics.csv, tensorboard)"),
    "swanlab_project": Flag(noop="SwanLab logging is not supported"),
    "enable_wandb_log": Flag("switch", default=False, refuse="wandb logging is not supported (metrics.csv, tensorboard)"),
    "wandb_project": Flag(noop="wandb logging is not supported"),
    # splitflow's own additions, in the same style
    "lora_alpha": Flag(key="train.lora_alpha"),
    "seed": Flag(key="train.seed"),
    "model_base_path": Flag(),  # where DiffSynth keeps downloads; default $DIFFSYNTH_MODEL_BASE_PATH or ./models
    **{f"dmd2_{name}": Flag(refuse="DMD2 distillation is not supported") for name in _DMD2},
}

# --extra_inputs a row gives without a column of its own -> the config setting that reads it so
# (examples/wanvideo/model_training/train.py parse_extra_inputs: input_image is the video's first frame).
EXTRA_INPUTS = {"input_image": ("dataset.first_frame_reference", True)}

# --task (DiffSynth's launcher_map) -> the verb that does that work.
TASKS = {"sft": None, "sft:data_process": "preprocess", "sft:train": "train"}


# --- argv -------------------------------------------------------------------------------------

def _flag_name(token: str) -> str | None:
    """The flag a token names when it is DiffSynth's (known, or snake_case like DiffSynth's), else None."""
    if not token.startswith("--"):
        return None
    name = token[2:].split("=", 1)[0]
    return name if name in FLAGS or "_" in name else None


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(splitflow's own arguments, DiffSynth flag tokens)``; ``run --task sft:train`` becomes ``train``.

    DiffSynth flags must leave argv before argparse sees it, or their values would be taken for CONFIG.
    """
    own, foreign, i = [], [], 0
    while i < len(argv):
        token, name = argv[i], _flag_name(argv[i])
        takes_value = name is not None and "=" not in token and FLAGS.get(name, Flag()).kind != "switch"
        if name is None:
            own.append(token)
        elif takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            foreign += [token, argv[i + 1]]
            i += 1
        else:
            foreign.append(token)
        i += 1
    task = parse_flags(foreign, strict=False).get("task")
    verb = next((i for i, token in enumerate(own) if not token.startswith("-")), None)
    if TASKS.get(task) and verb is not None and own[verb] == "run":
        own[verb] = TASKS[task]
    return own, foreign


def parse_flags(tokens: list[str], strict: bool = True) -> dict[str, str]:
    """``{flag: raw value}`` (the last one wins, as with argparse); every bad token is reported at once."""
    flags, bad, i = {}, [], 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:].split("=", 1)[0] if token.startswith("--") else None
        flag = FLAGS.get(name)
        if flag is None:
            bad.append(token)
        elif "=" in token:
            flags[name] = token.split("=", 1)[1]
        elif flag.kind == "switch":
            flags[name] = "true"
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            flags[name] = tokens[i + 1]
            i += 1
        else:
            bad.append(f"{token} (needs a value)")
        i += 1
    if bad and strict:
        raise ConfigError(f"unknown or incomplete argument(s): {', '.join(bad)} (DiffSynth-Studio flags "
                          "splitflow accepts: docs/diffsynth.md)")
    return flags


def _value(flag: Flag, raw: str) -> Any:
    if flag.kind == "list":
        return [part.strip() for part in raw.split(",") if part.strip()]
    if flag.kind == "switch":
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"switch flag given the value {raw!r}: use the bare flag")
        return raw.lower() in ("true", "1")
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


# --- flags -> config data ----------------------------------------------------------------------

def _check_refused(flags: dict[str, str]) -> None:
    refused = [f"--{name} ({FLAGS[name].refuse})" for name, raw in flags.items()
               if FLAGS[name].refuse and (FLAGS[name].default is None or _value(FLAGS[name], raw) != FLAGS[name].default)]
    task = flags.get("task")
    if task is not None and task not in TASKS:
        refused.append(f"--task {task} (splitflow runs {', '.join(TASKS)}; DiffSynth's distillation tasks are "
                       "not supported)")
    if refused:
        raise ConfigError(f"DiffSynth-Studio flag(s) splitflow cannot honour: {'; '.join(refused)}")


def _extra_inputs(flags: dict[str, str]) -> list[str]:
    return _value(FLAGS["extra_inputs"], flags.get("extra_inputs", ""))


def _check_extra_inputs(flags: dict[str, str]) -> None:
    """``--extra_inputs``: reference images are cached (stage 1 encodes them); other inputs are refused."""
    from diffsynth_core.data.references import REFERENCE_COLUMNS, is_reference_column

    others = [name for name in _extra_inputs(flags) if not is_reference_column(name) and name not in EXTRA_INPUTS]
    if others:
        raise ConfigError(f"--extra_inputs {','.join(others)}: splitflow caches reference images only "
                          f"({', '.join(REFERENCE_COLUMNS + tuple(EXTRA_INPUTS))}); {_IMAGE_ONLY}")


def _apply_extra_inputs(data: dict, flags: dict[str, str]) -> None:
    for name in _extra_inputs(flags):
        if name in EXTRA_INPUTS:
            apply_override(data, *EXTRA_INPUTS[name])


def _print_notices(flags: dict[str, str]) -> None:
    for name in flags:
        flag = FLAGS[name]
        note = flag.noop or flag.refuse  # a refused flag given its harmless default is a no-op
        if note:
            print(f"splitflow: --{name} has no effect here: {note}", file=sys.stderr)


def _apply_mapped(data: dict, flags: dict[str, str], defaults: bool) -> None:
    for name, flag in FLAGS.items():
        if flag.key is None:
            continue
        if name in flags:
            apply_override(data, flag.key, _value(flag, flags[name]))
        elif defaults and flag.default is not None:
            apply_override(data, flag.key, _value(flag, str(flag.default)))


def _apply_models(data: dict, flags: dict[str, str], sets: list[str], defaults: bool) -> str:
    """Model family and sources from the model flags; the family of the config otherwise."""
    from . import diffsynth_models as models

    wanted = next((s.split("=", 1)[1].strip() for s in sets if s.replace(" ", "").startswith("model.family=")), None)
    model = data.setdefault("model", {})
    if not (flags.get("model_paths") or flags.get("model_id_with_origin_paths")):
        if defaults:
            raise ConfigError("no model: give --model_id_with_origin_paths or --model_paths (DiffSynth-Studio "
                              "style), or a CONFIG file with model.path")
        return wanted or model.get("family", "qwen_image")
    family, sources = models.resolve_models(flags, wanted or model.get("family"))
    models.add_tokenizers(family, sources, flags)
    model["family"] = family
    model["sources"] = {**model.get("sources", {}), **sources}
    return family


def _translate(targets: list[str], aliases: dict[str, tuple[str, ...]]) -> list[str]:
    return list(dict.fromkeys(t for target in targets for t in aliases.get(target, (target,))))


def _apply_training(data: dict, flags: dict[str, str], defaults: bool, family: str, stage: str) -> None:
    """What trains (LoRA on the DiT or the DiT itself) and on which modules, in diffusers names."""
    from diffsynth_core.models import get_family

    spec = get_family(family)
    base = flags.get("lora_base_model")
    if base not in (None, "dit"):
        raise ConfigError(f"--lora_base_model {base}: splitflow trains LoRA on the DiT only (dit)")
    trainable = _value(FLAGS["trainable_models"], flags["trainable_models"]) if "trainable_models" in flags else []
    others = [m for m in trainable if m != "dit"]
    if others:
        raise ConfigError(f"--trainable_models {','.join(others)}: stage 2 trains only the DiT (dit) from the cache")
    if trainable and base is None:
        apply_override(data, "train.trainable_models", [spec.transformer_component])
        apply_override(data, "train.lora_rank", 0)
        # DiffSynth adds no LoRA without --lora_base_model, so it never reads these (nor their defaults)
        ignored = [f"--{flag}" for flag in ("lora_alpha", "lora_target_modules") if flag in flags]
        if ignored:
            print(f"splitflow: {' and '.join(ignored)} ignored: --trainable_models dit alone is full fine-tuning, "
                  "with no LoRA (as in DiffSynth)", file=sys.stderr)
        apply_override(data, "train.lora_alpha", None)
        apply_override(data, "train.lora_target_modules", None)
        return
    if trainable:
        print("splitflow: --trainable_models dit with --lora_base_model dit: as in DiffSynth, the DiT stays frozen "
              "under its LoRA, so only the LoRA trains", file=sys.stderr)
    elif base is None and defaults and stage in ("run", "train", "resume"):
        print("splitflow: neither --lora_base_model nor --trainable_models: training a LoRA on the DiT "
              "(DiffSynth would have nothing to train)", file=sys.stderr)
    raw = flags.get("lora_target_modules", FLAGS["lora_target_modules"].default if defaults else None)
    if raw is None:
        return
    if not raw.strip():  # DiffSynth auto-detects the block Linears of >= 512 features (training_module.py)
        print(f"splitflow: --lora_target_modules \"\" (DiffSynth's auto-detection): training {family}'s default "
              f"targets {list(spec.lora_target_modules)}", file=sys.stderr)
        apply_override(data, "train.lora_target_modules", None)
        return
    targets = _translate(_value(FLAGS["lora_target_modules"], raw), spec.lora_target_aliases)
    if "lora_target_modules" not in flags and not all(t in spec.lora_target_aliases for t in raw.split(",")):
        print(f"splitflow: DiffSynth's default LoRA targets ({raw}) are Wan's module names; using {family}'s "
              f"defaults {list(spec.lora_target_modules)}", file=sys.stderr)
        apply_override(data, "train.lora_target_modules", None)
        return
    apply_override(data, "train.lora_target_modules", targets)


def _apply_timestep_boundaries(data: dict, flags: dict[str, str], family: str) -> None:
    """``--min/--max_timestep_boundary`` -> ``train.sigma_range``.  DiffSynth draws the index
    ``randint(min * 1000, max * 1000)`` of its 1000-point training schedule (diffsynth/diffusion/loss.py),
    sigma 1 first; those points are exactly the ones in ``[grid[max * 1000 - 1], grid[min * 1000]]``,
    and the run trains the expert(s) serving that range (``training/experts.py``)."""
    if "max_timestep_boundary" not in flags and "min_timestep_boundary" not in flags:
        return
    from diffsynth_core.models import get_family
    from diffsynth_core.training.flow_matching import DIFFSYNTH_STEPS, diffsynth_sigmas

    low = _value(Flag(), flags.get("min_timestep_boundary", "0"))
    high = _value(Flag(), flags.get("max_timestep_boundary", "1"))
    if not all(isinstance(v, (int, float)) for v in (low, high)) or not 0 <= low < high <= 1:
        raise ConfigError(f"--min_timestep_boundary {low} --max_timestep_boundary {high}: each must lie in [0, 1], "
                          "min below max (fractions of the training schedule, 0 = pure noise)")
    template = get_family(family).diffsynth_template
    if template is None:
        raise ConfigError(f"--max_timestep_boundary/--min_timestep_boundary: family {family} has no DiffSynth "
                          "training schedule to take them in")
    grid = diffsynth_sigmas(template)
    first, last = int(low * DIFFSYNTH_STEPS), int(high * DIFFSYNTH_STEPS) - 1
    if last < first:
        raise ConfigError(f"--min_timestep_boundary {low} --max_timestep_boundary {high} select no point of the "
                          f"{DIFFSYNTH_STEPS}-step schedule: widen them")
    apply_override(data, "train.sigma_range", [float(grid[last]), float(grid[first])])


def _apply_family_defaults(data: dict, flags: dict[str, str], defaults: bool, family: str) -> None:
    from diffsynth_core.models import get_family

    if get_family(family).frame_multiple == 1 or not defaults:
        return
    if "num_frames" not in flags:
        apply_override(data, "dataset.num_frames", 81)  # add_video_size_config's default
    apply_override(data, "train.gradient_checkpointing", True)  # Wan's train.py forces it on, whatever the flag says


def _apply_dataset(data: dict, flags: dict[str, str], stage: str) -> None:
    """DiffSynth trains on a cache folder when no metadata is given (its sft:train step)."""
    from . import diffsynth_models as models

    dataset = data.get("dataset", {})
    if dataset.get("metadata_path") or "dataset_base_path" not in flags:
        return
    folder = Path(flags["dataset_base_path"])
    if stage != "train":
        raise ConfigError("--dataset_metadata_path is missing: it is needed to encode a dataset (to train on a cache "
                          "written by `splitflow preprocess`, use --task sft:train)")
    found = models.cache_in_folder(folder)
    if found is not None:
        apply_override(data, "cache.url", found[0])
        apply_override(data, "cache.backend", found[1])
        _inherit_preprocess(data, folder)
    elif models.is_diffsynth_cache(folder):
        raise ConfigError(f"{folder} is a DiffSynth-Studio cache (<rank>/<i>.pth): import it first with "
                          f"`splitflow cache import {folder} DEST`, then train with --set cache.url=DEST")
    else:
        raise ConfigError(f"--dataset_metadata_path is missing and {folder} holds no cache.zarr or cache.pth "
                          "written by `splitflow preprocess`")


def _inherit_preprocess(data: dict, folder: Path) -> None:
    """The dataset and encoders that encoded the cache in ``folder`` (``preprocess.toml``, written by
    ``splitflow preprocess``): training checks the cache against them and derives its keys from them."""
    from ..preprocess import PREPROCESS_CONFIG

    if not (folder / PREPROCESS_CONFIG).is_file():
        raise ConfigError(f"{folder} holds a cache but no {PREPROCESS_CONFIG} (written by `splitflow preprocess`): "
                          "give --dataset_metadata_path and the encoders too, or a CONFIG file")
    encoded = read_config_file(folder / PREPROCESS_CONFIG)
    data["dataset"] = {**encoded.get("dataset", {}), **{k: v for k, v in data.get("dataset", {}).items()
                                                      if k in ("repeat",)}}
    model, before = data.setdefault("model", {}), encoded.get("model", {})
    for key in ("path", "dtype"):
        if key in before:
            model.setdefault(key, before[key])
    model["sources"] = {**(before.get("sources") or {}), **(model.get("sources") or {})}
    data.setdefault("preprocess", {})["max_sequence_length"] = encoded.get("preprocess", {}).get("max_sequence_length")


def _stage(verb: str, flags: dict[str, str]) -> str:
    wanted = TASKS.get(flags.get("task", "sft"))
    if wanted is not None and verb not in (wanted, "run", "status", "resume"):
        raise ConfigError(f"--task {flags['task']} is `splitflow {wanted}`, not `splitflow {verb}`")
    return wanted or verb


def run_config_from_cli(config: str | None, sets: list[str], tokens: list[str], verb: str) -> RunConfig:
    """The ``RunConfig`` of a command line: CONFIG file (optional) < DiffSynth flags < ``--set``."""
    flags = parse_flags(tokens)
    _check_refused(flags)
    _check_extra_inputs(flags)
    if config is None and verb == "deploy":
        raise ConfigError("splitflow deploy registers a CONFIG file: write one (see examples/), or run the command "
                          "once with `splitflow train` and deploy the config.toml it saves under --output_path")
    if config is None and not flags:
        raise ConfigError("give a CONFIG file (see examples/) or DiffSynth-Studio flags "
                          "(--model_id_with_origin_paths ... --dataset_base_path ...)")
    _print_notices(flags)
    stage = _stage(verb, flags)
    data = read_config_file(config) if config else {}
    defaults = config is None
    _apply_mapped(data, flags, defaults)
    _apply_extra_inputs(data, flags)
    family = _apply_models(data, flags, list(sets), defaults)
    _apply_training(data, flags, defaults, family, stage)
    _apply_family_defaults(data, flags, defaults, family)
    _apply_timestep_boundaries(data, flags, family)
    _apply_dataset(data, flags, stage)
    if flags:  # a DiffSynth user's next command (validate.py) looks for <output_path>/epoch-K.safetensors
        data.setdefault("output", {})["diffsynth_files"] = True  # (--set output.diffsynth_files=false wins)
    # LoRA targets are checked against the model by the verb, once it knows training has work left
    # (flows/orchestrate.py): building the DiT on meta costs seconds a finished run need not pay.
    return build_config(data, list(sets), source=config or "DiffSynth-Studio flags")


def flag_overrides(tokens: list[str]) -> list[str]:
    """``section.key=value`` overrides for the flags that map onto one key (``splitflow demo``)."""
    flags = parse_flags(tokens)
    unmapped = [f"--{name}" for name in flags if FLAGS[name].key is None and not FLAGS[name].noop]
    if unmapped:
        raise ConfigError(f"{', '.join(unmapped)}: not accepted here (only flags that set one config key)")
    out = []
    for name, raw in flags.items():
        if FLAGS[name].key is not None:
            value = _value(FLAGS[name], raw)
            out.append(f"{FLAGS[name].key}={json.dumps(value) if isinstance(value, (list, bool)) else value}")
    return out
