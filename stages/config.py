"""`RunConfig`: the one typed configuration every stage, flow and CLI verb receives.

Sections hold plain values only (no devices, modules or open stores); live objects are built
from them at run time.  Loads from TOML or YAML, takes ``--set section.key=value`` overrides
(DiffSynth-Studio flags are translated in ``stages/compat/diffsynth.py``), and is saved beside
every output as ``config.toml``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import tomli_w
import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from diffsynth_core.errors import InputError
from diffsynth_core.training.optimizers import step_in_backward_conflict
from diffsynth_core.training.optimizers import split_name as _optimizer_name

from .secrets import literal_secrets

log = logging.getLogger(__name__)


class ConfigError(InputError):
    """A config file, key or value is wrong; the message names the dotted key (exit code 2)."""


# Devices the stages can run on ("auto": the first CUDA device if any, else the CPU).
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|(cuda|xpu)(:\d+)?)$")


def _check_device(value: str) -> str:
    if not _DEVICE_RE.match(value):
        raise ValueError(f"{value!r} is not a device splitflow can use: auto, cpu, cuda or cuda:N")
    return value


class _Section(BaseModel):
    # Unknown keys are errors: a typo must never be silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _multiple_of_16(value: int | None) -> int | None:
    if value is not None and (value <= 0 or value % 16):
        raise ValueError(f"must be a positive multiple of 16, got {value}")
    return value


def _caption_extension(value: str | None) -> str | None:
    # Caption files are found with Path.with_suffix: what it refuses, or "" (which it takes as
    # "strip the suffix"), is no extension.
    if value is None:
        return value
    try:
        Path("caption").with_suffix(value)
        is_extension = value != ""
    except ValueError:
        is_extension = False
    if not is_extension:
        raise ValueError(f"{value!r} is not a file extension: give it with its dot, e.g. \".txt\"")
    return value


_MultipleOf16 = Annotated[int | None, AfterValidator(_multiple_of_16)]


class DatasetSource(_Section):
    """One of several datasets (``dataset.sources``); unset values come from ``[dataset]``.

    A source that sets ``max_pixels`` or ``height``/``width`` brings its own size rule."""
    metadata_path: str = Field(min_length=1)  # metadata file or media folder
    base_path: str = ""
    repeat: int = Field(1, ge=1)
    caption_extension: Annotated[str | None, AfterValidator(_caption_extension)] = None
    max_pixels: int | None = Field(None, gt=0)
    height: _MultipleOf16 = None
    width: _MultipleOf16 = None
    num_frames: int | None = Field(None, ge=1)
    # Reference images (docs/datasets.md, "Reference images"): a folder of same-stem control images
    # (musubi-tuner's control_directory), and this source's own reference sizing (None: [dataset]'s).
    control_directory: str | None = None
    reference_size: Literal["family", "target", "own"] | None = None
    reference_pixels: int | None = Field(None, gt=0)


class DatasetSection(_Section):
    base_path: str = ""
    metadata_path: str = ""
    data_file_keys: list[str] = ["image", "video"]
    repeat: int = Field(1, ge=1)
    max_pixels: int = Field(1024 * 1024, gt=0)
    height: _MultipleOf16 = None
    width: _MultipleOf16 = None
    num_frames: int = Field(1, ge=1)
    skip_bad_samples: bool = False
    # Transparent pixels are composited on this colour (a name, #rgb or #rrggbb), never trained as
    # whatever colour the file hides under them.
    background: str = "white"
    # Media paths must resolve inside base_path (no ../, absolute paths or symlinks out of it).
    allow_external_paths: bool = False
    # Folder datasets (kohya/musubi-tuner): media files with same-name caption files.
    caption_extension: Annotated[str, AfterValidator(_caption_extension)] = ".txt"
    # Several datasets with their own repeats and sizes; a musubi-tuner dataset TOML given as
    # metadata_path is expanded into these (stages/compat/musubi.py, docs/datasets.md).
    sources: list[DatasetSource] = []
    # How reference images are sized for the VAE: "family" (the model's rule: about 1024² for
    # Qwen-Image-Edit; reference_pixels replaces its area), "target" (the target's size), "own" (their
    # own size floored to the multiple, at most reference_pixels).
    reference_size: Literal["family", "target", "own"] = "family"
    reference_pixels: int | None = Field(None, gt=0)
    # A video row naming no reference image takes its own first frame as one (DiffSynth-Studio's
    # `--extra_inputs input_image`: Wan2.2 TI2V-5B trains image-to-video); image-to-video models do so anyway.
    first_frame_reference: bool = False

    @field_validator("background")
    @classmethod
    def _background_is_a_colour(cls, value: str) -> str:
        from PIL import ImageColor

        try:
            ImageColor.getrgb(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a colour: use a name (white, black), #rgb or #rrggbb") from None
        return value

    @model_validator(mode="after")
    def _one_kind_of_dataset(self):
        if self.sources and self.metadata_path and not self.metadata_path.endswith(".toml"):
            raise ValueError("give dataset.metadata_path or dataset.sources, not both")
        return self


class ModelSection(_Section):
    family: str = "qwen_image"
    # A named configuration of the family's architecture ("edit-2509", "klein-4b", "ti2v-5b"):
    # None = told from the files, where they tell (docs/design.md, "Variants").
    variant: str | None = None
    path: str = ""                       # model folder in the diffusers layout
    transformer_file: str | None = None  # optional single .safetensors DiT replacing path/transformer
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # Components loaded from files as released instead of model.path: {"transformer": [files or
    # folders], "vae": [...], "tokenizer": [folder], ...} (docs/diffsynth.md lists the formats).
    sources: dict[str, list[str]] | None = None
    # Qwen-Image-Edit-2511's zero_cond_t (reference tokens at timestep 0): None = the transformer's config.
    zero_cond_t: bool | None = None
    # Two experts (Wan2.2 A14B): the sigma where the second takes over; None: the folder's
    # model_index.json, else the release's (docs/training.md, "Experts").
    boundary_ratio: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="after")
    def _sources_name_files(self):
        for name, paths in (self.sources or {}).items():
            if not paths or not all(isinstance(p, str) and p for p in paths):
                raise ValueError(f"model.sources.{name} must be a non-empty list of file or folder paths")
        return self


class CacheSection(_Section):
    url: str = ""  # empty: <output.path>/cache.<backend>
    backend: Literal["zarr", "pth"] = "zarr"
    storage_options: dict[str, Any] = {}
    allow_partial: bool = False


class PreprocessSection(_Section):
    parts: int = Field(1, ge=1)
    retries: int = Field(2, ge=0)
    device: str = "auto"
    max_sequence_length: int | None = Field(None, ge=1)
    commit_every: int = Field(16, ge=1)
    # Stream encoder weights from host memory: "auto" on a GPU only; true/false force it.
    offload_encoders: Literal["auto", True, False] = "auto"
    # Scale-out (docs/scaling.md): samples per encoder call (grouped by shape), background decoding
    # threads, the GPU memory one part may use (0: no limit), VAE tiling ("auto": when the budget
    # needs it), and the devices parts are spread over ("all" GPUs or a list; empty: `device`).
    batch_size: int = Field(1, ge=1)
    decode_workers: int = Field(2, ge=0)
    vram_budget_gb: float = Field(0.0, ge=0, allow_inf_nan=False)
    vae_tiling: Literal["auto", True, False] = "auto"
    devices: Literal["all"] | list[str] = []

    @model_validator(mode="after")
    def _devices_are_named(self):
        if isinstance(self.devices, list) and any(not isinstance(d, str) or not d.strip() for d in self.devices):
            raise ValueError(f"preprocess.devices must be \"all\" or a list of device names, got {self.devices}")
        return self

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        return _check_device(value)


class TrainSection(_Section):
    learning_rate: float = Field(1e-4, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.01, ge=0, allow_inf_nan=False)
    optimizer: str = "torch.optim.AdamW"
    # More constructor arguments of the optimizer (musubi-tuner's and kohya's --optimizer_args), e.g.
    # {betas = [0.9, 0.99], eps = 1e-6, fused = true}; lr and weight_decay are the keys above.
    optimizer_args: dict[str, bool | int | float | str | list[float]] = {}
    max_steps: int | None = Field(None, ge=1)
    num_epochs: int = Field(1, ge=1)
    save_steps: int = Field(0, ge=0)  # 0: checkpoint only at the end
    keep_checkpoints: int = Field(3, ge=1)
    seed: int = Field(0, ge=0, lt=2**32)  # torch generators take 64 bits; seeds are mixed with draw serials
    gradient_accumulation_steps: int = Field(1, ge=1)
    batch_size: int = Field(1, ge=1)  # samples per forward pass (bucketed by shape)
    max_grad_norm: float | None = Field(1.0, ge=0, allow_inf_nan=False)  # 0 (or null): no clipping
    warmup_steps: int = Field(0, ge=0)
    lora_rank: int = Field(16, ge=0)  # 0 together with trainable_models: full fine-tuning
    lora_alpha: float | None = Field(None, gt=0, allow_inf_nan=False)  # None: equal to the rank (scale 1)
    lora_target_modules: list[str] | None = None  # None: the family's defaults; [] is refused (no target)
    lora_init: Literal["gaussian", "default", "pissa", "olora"] = "gaussian"
    # Adapters save their Linear's bf16 input instead of peft's fp32 copy (training/adapter_inputs.py):
    # bitwise the same gradients, less activation memory, 2-5 % slower steps on the H200 (docs/training.md).
    lora_narrow_inputs: bool = False
    preset_lora_path: str | None = None  # a LoRA fused into the base weights before training (at its alpha/r)
    lora_checkpoint: str | None = None   # a LoRA whose training continues (its rank, alpha, targets, weights)
    trainable_models: list[str] = []
    gradient_checkpointing: bool = True
    # Checkpointed block inputs in host memory; "auto": on when a GPU budget (offload.vram_budget_gb)
    # cannot hold them beside the step (training/prepare.py activations_need_host, docs/offload.md).
    gradient_checkpointing_offload: bool | Literal["auto"] = "auto"
    # "auto": the family's default (DiffSynth's schedule for every built-in family); docs/training.md
    timestep_sampling: Literal["auto", "uniform", "logit_normal", "shift", "resolution_shift", "diffsynth"] = "auto"
    logit_mean: float = Field(0.0, allow_inf_nan=False)
    logit_std: float = Field(1.0, gt=0, allow_inf_nan=False)
    shift: float = Field(3.0, gt=0, allow_inf_nan=False)
    loss_weighting: Literal["auto", "none", "sigma_sqrt", "cosmap", "diffsynth"] = "auto"
    device: str = "auto"
    retries: int = Field(1, ge=0)
    tensorboard: bool = False
    validation_prompts: list[str] = []
    validation_steps: int = Field(0, ge=0)  # 0: no validation images
    validation_inference_steps: int = Field(20, ge=1)
    # Batches, caption dropout, EMA (docs/training.md).
    drop_last: bool = False  # a bucket's last batch smaller than batch_size: dropped (true) or trained (false)
    caption_dropout: float = Field(0.0, ge=0, le=1)  # probability of training a sample on the empty prompt
    ema_decay: float = Field(0.0, ge=0, lt=1)  # 0: no EMA; else e.g. 0.999, exported as lora_ema.safetensors
    # Bitwise repeatable CUDA runs (deterministic kernels, cuBLAS workspace, seeded RNGs); slower.
    deterministic: bool = False
    # Each block's forward compiled by torch.compile (diffsynth_core/training/compile.py): on the H200 the
    # real-width Qwen-Image step takes 0.67-0.74x the eager time; close to, not bitwise equal to, an eager run.
    compile_blocks: bool = False
    # A step whose loss or gradients are NaN/Inf is skipped (no update); this many in a row stop the run.
    max_nonfinite_steps: int = Field(3, ge=1)
    # Two-expert models (Wan2.2 A14B, docs/training.md "Experts"): the experts this run trains by
    # component (None: those sigma_range reaches, both by default), and the sigmas drawn.
    experts: list[str] | None = None
    sigma_range: tuple[float, float] = (0.0, 1.0)

    @field_validator("sigma_range")
    @classmethod
    def _sigma_range_is_ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"[{low}, {high}] must satisfy 0 <= min < max <= 1 (sigma 1 is pure noise)")
        return value

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        return _check_device(value)

    @field_validator("lora_target_modules")
    @classmethod
    def _targets_name_modules(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not [name for name in value if name.strip()]:
            raise ValueError("an empty list names no module to train: leave the key out for the family's "
                             "default targets, or name modules such as ['to_q', 'to_k']")
        return value

    @field_validator("optimizer")
    @classmethod
    def _optimizer_is_allowed(cls, value: str) -> str:
        _optimizer_name(value)  # a name from the allow-list, never an import path to follow
        return value

    @field_validator("optimizer_args")
    @classmethod
    def _optimizer_args_leave_own_keys(cls, value: dict) -> dict:
        from diffsynth_core.training.optimizers import OWN_KEYS

        for key in value:
            if key in OWN_KEYS:
                raise ValueError(f"{key!r} is set by {OWN_KEYS[key]}, not here")
        return value

    @model_validator(mode="after")
    def _lora_keys_need_adapters(self):
        # Full fine-tuning trains the transformer itself: a LoRA-only key would be silently ignored.
        if self.lora_rank == 0 and self.trainable_models:
            lora_only = {"lora_alpha": self.lora_alpha is not None,
                         "lora_target_modules": self.lora_target_modules is not None,
                         "lora_narrow_inputs": self.lora_narrow_inputs}
            for key, is_set in lora_only.items():
                if is_set:
                    raise ValueError(f"train.{key} applies to LoRA adapters, and full fine-tuning "
                                     "(train.lora_rank = 0 with train.trainable_models) has none; remove it")
        return self

    @model_validator(mode="after")
    def _compiled_or_deterministic(self):
        if self.compile_blocks and self.deterministic:
            raise ValueError("train.compile_blocks and train.deterministic together: compiled kernels are not "
                             "checked for bitwise repeatability on GPUs; set one of them to false")
        return self


class OffloadSection(_Section):
    enable_model_cpu_offload: bool = False
    enable_optimizer_cpu_offload: bool = False
    # The optimizer's state (AdamW's moments) waits in pinned host memory between steps; the step
    # itself stays on the GPU (docs/offload.md).  Nothing to do on a CPU run.
    optimizer_state_on_host: bool = False
    # Each page of trainable weights steps during backward, as soon as its gradients are in, its state
    # paged in from host memory (StepInBackward): neither state nor gradients sit at the backward's
    # peak.  Needs train.max_grad_norm = 0, no accumulation, one process, Adam/AdamW/SGD (built fused).
    optimizer_step_in_backward: bool = False
    # MB, as in DiffSynth-Studio: a unit with more bytes of weights is split into its children.
    cpu_offload_split_threshold: float | None = Field(None, gt=0, allow_inf_nan=False)
    # Cap on the GPU's peak memory (GiB) or "auto" (what is free, minus 5 %); 0: stream every block.
    vram_budget_gb: float | Literal["auto"] = 0.0
    prefetch: int = Field(1, ge=0)
    granularity: Literal["block", "leaf"] = "block"
    # Host copy (and copies to the GPU) of frozen weights; fp8 uses one scale per row;
    # "packed_bfloat16" keeps bf16 weights in ~12 bits each, lossless (docs/offload.md).
    storage_dtype: Literal["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "packed_bfloat16"] | None = None

    @field_validator("vram_budget_gb", mode="before")
    @classmethod
    def _budget_is_auto_or_finite(cls, value: Any) -> Any:
        # one message for both forms (a union would report each branch's complaint)
        if value == "auto":
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"Input should be a finite number >= 0 (GiB) or 'auto', got {value!r}") from None
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"Input should be a finite number >= 0 (GiB) or 'auto', got {value!r}")
        return number


class OutputSection(_Section):
    path: str = "./splitflow-out"
    # LoRA files besides the final lora*.safetensors, in <path>/loras/ (docs/lora_files.md):
    # "epoch": epoch-K (K from 0, as DiffSynth-Studio), "save": step-N at every checkpoint, "end": none.
    export_every: Literal["epoch", "save", "end"] = "epoch"
    # Each of those exports also as <path>/epoch-K.safetensors (step-N) in DiffSynth-Studio's own format,
    # where its validate.py loads it; a DiffSynth command line sets it (docs/diffsynth.md).
    diffsynth_files: bool = False


class OrchestrationSection(_Section):
    """How the flows talk to Prefect and recover stage runs on work pools (docs/orchestration.md)."""

    api_grace_s: float = Field(60.0, gt=0)     # stop waiting once the Prefect API is unreachable this long
    retry_delay_s: float = Field(10.0, ge=0)   # first re-submission of a failed stage run; doubles each time
    heartbeat_s: float = Field(10.0, gt=0)     # how often a running stage run reports progress
    stale_after_s: float = Field(60.0, gt=0)   # a stage run silent this long is presumed lost and re-submitted
    poll_s: float = Field(2.0, gt=0)           # how often the coordinator reads stage run states

    @model_validator(mode="after")
    def _stale_after_heartbeats(self):
        if self.stale_after_s < 2 * self.heartbeat_s:
            raise ValueError(f"orchestration.stale_after_s ({self.stale_after_s}) must be at least twice "
                             f"orchestration.heartbeat_s ({self.heartbeat_s}), or live runs look lost")
        return self


# Local paths a user may write as ~/...; URLs (s3://...) never start with "~".
_PATH_KEYS = ("output.path", "cache.url", "model.path", "model.transformer_file", "dataset.base_path",
              "dataset.metadata_path", "train.lora_checkpoint", "train.preset_lora_path")


class RunConfig(_Section):
    dataset: DatasetSection = DatasetSection()
    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    preprocess: PreprocessSection = PreprocessSection()
    train: TrainSection = TrainSection()
    offload: OffloadSection = OffloadSection()
    output: OutputSection = OutputSection()
    orchestration: OrchestrationSection = OrchestrationSection()

    @model_validator(mode="before")
    @classmethod
    def _home_expanded(cls, data: Any) -> Any:
        """``~/out`` is the user's home, as a shell (and media paths) read it, not a folder named ``~``."""
        if isinstance(data, dict):
            for dotted in _PATH_KEYS:
                section, key = dotted.split(".")
                table = data.get(section)
                if isinstance(table, dict) and isinstance(table.get(key), str) and table[key].startswith("~"):
                    table[key] = os.path.expanduser(table[key])
        return data

    @model_validator(mode="after")
    def _output_is_a_folder(self):
        path = Path(self.output.path)
        if path.exists() and not path.is_dir():
            raise ValueError(f"output.path: {path} is a file, not a folder; name a folder (it is created if missing)")
        return self

    @model_validator(mode="after")
    def _step_in_backward_fits(self):
        conflict = self.offload.optimizer_step_in_backward and step_in_backward_conflict(self.train, self.offload)
        if conflict:  # refused here, before preprocessing, as well as when training starts
            raise ValueError(conflict)
        return self

    @model_validator(mode="after")
    def _validation_needs_a_pipeline_folder(self):
        if self.train.validation_prompts and self.model.sources and not self.model.path:
            raise ValueError("train.validation_prompts renders with the diffusers pipeline, which needs model.path "
                             "(a diffusers-layout folder); model.sources alone cannot build it")
        return self

    # -- derived paths ------------------------------------------------------------------------
    @property
    def output_dir(self) -> Path:
        return Path(self.output.path)

    @property
    def cache_url(self) -> str:
        if self.cache.url:
            return self.cache.url
        return str(self.output_dir / f"cache.{self.cache.backend}")

    # -- (de)serialisation --------------------------------------------------------------------
    def to_toml(self) -> str:
        return tomli_w.dumps(self.model_dump(mode="json", exclude_none=True))

    def save(self, path: Path | str) -> Path:
        """Write the resolved config atomically (temp file + rename), readable by its owner only.

        ``cache.storage_options`` is written as given: references (``${ENV}``, ``prefect-secret:``)
        stay references; a literal credential is kept (a saved config must rerun) but warned about.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        literal = literal_secrets(self.cache.storage_options, "cache.storage_options")
        if literal:
            log.warning("%s holds a literal credential in %s; write a reference such as "
                        "\"${AWS_SECRET_ACCESS_KEY}\" instead so no secret is stored on disk", path, ", ".join(literal))
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), 0o600)  # also when a stale temp file had another mode
            handle.write(self.to_toml())
        tmp.replace(path)
        return path


def _parse_value(text: str) -> Any:
    """Interpret an override value as TOML (numbers, booleans, lists), else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if "," in text:  # DiffSynth style comma lists: to_q,to_k
            return [part for part in text.split(",") if part]
        return text


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data[section][key] = value`` for ``dotted = "section.key"``, or one entry of a table-valued
    key for ``"section.key.entry"`` (``train.optimizer_args.eps=1e-6``); errors name the key."""
    section, _, key = dotted.partition(".")
    key, _, entry = key.partition(".")
    if not key or section not in RunConfig.model_fields:
        known = ", ".join(RunConfig.model_fields)
        raise ConfigError(f"--set {dotted}: expected section.key with section one of {known}")
    fields = RunConfig.model_fields[section].annotation.model_fields
    if key not in fields:
        raise ConfigError(f"--set {dotted}: unknown key {key!r} in section [{section}]")
    if not entry:
        data.setdefault(section, {})[key] = value
    elif typing.get_origin(fields[key].annotation) is dict:
        table = data.setdefault(section, {}).setdefault(key, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {dotted}: {section}.{key} is {table!r} here, not a table")
        table[entry] = value
    else:
        raise ConfigError(f"--set {dotted}: {section}.{key} is not a table; use --set {section}.{key}=VALUE")


def _format_validation_error(err: ValidationError, source: str, overridden: dict[str, str] | None = None) -> str:
    """Every problem on one line, each naming its dotted key (the CLI shows one line per failure); a value
    that came from ``--set`` is blamed on that ``--set``, not on the config file."""
    overridden = overridden or {}
    problems, from_file = [], False
    for item in err.errors():
        dotted = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        given = next((item for key, item in overridden.items() if dotted == key or dotted.startswith(key + ".")), None)
        if given is not None:
            problems.append(f"{dotted}: {message} (from --set {given})")
            continue
        from_file = True
        problems.append(f"{dotted}: {message}" if dotted else message)  # a rule across sections names its keys
    return (f"invalid config ({source}): " if from_file else "") + "; ".join(problems)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML takes the last one silently)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_config_file(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" + (" (it is a folder)" if path.is_dir() else ""))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"config file {path}: byte 0x{raw[err.start]:02x} on line {line} is not UTF-8 (a "
                          "Latin-1 or Windows-1252 file?): save it as UTF-8") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        elif path.suffix == ".json":
            from diffsynth_core.data.metadata import unique_keys

            data = json.loads(text, object_pairs_hook=unique_keys)
        else:
            data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, ValueError) as err:
        detail = " ".join(str(err).split()).replace('in "<unicode string>", ', "")  # YAML's name for the text
        raise ConfigError(f"cannot parse config file {path}: {detail}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a table of sections "
                          "([dataset], [model], [train], ...)")
    return data


def _plain(value: Any, dotted: str = "") -> Any:
    """``value`` as JSON types; a date, time or other value a config cannot hold names its key."""
    if isinstance(value, dict):
        return {k: _plain(v, f"{dotted}.{k}" if dotted else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ConfigError(f"{dotted or 'config'}: {value} is a {type(value).__name__}, which no setting takes; "
                      "put it in quotes if it is text")


def build_config(data: dict[str, Any], overrides: list[str] = (), source: str = "<config>") -> RunConfig:
    """Validate ``data`` after applying ``section.key=value`` overrides; collects every error."""
    data = _plain(data)  # deep copy, plain types only
    overridden = {}  # dotted key -> the --set that gave it (errors blame the --set)
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        apply_override(data, dotted.strip(), _parse_value(raw.strip()))
        overridden[dotted.strip()] = item
    from .compat.musubi import expand_dataset_config  # a musubi dataset TOML -> dataset.sources

    data = expand_dataset_config(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source, overridden)) from None


def load_config(path: Path | str, overrides: list[str] = ()) -> RunConfig:
    return build_config(read_config_file(path), overrides, source=str(path))
