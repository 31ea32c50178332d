"""Stage 2: train the DiT (LoRA or full) from the cache, resuming from the last checkpoint.

Only the transformer is loaded; prompts and pixels come from the cache.  Which entries to
train on comes from this run's config (``stages.keys``), and so do the runtime settings
(checkpointing, offload, device), never from the cache.  One training per output folder (a
lock names the holder); checkpoints record the base model they were trained on.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from diffsynth_core.models import Expert, FamilySpec, check_model_folder
from diffsynth_core.models.experts import with_folder_boundary
from diffsynth_core.models.lora_export import DIFFUSERS_FILE
from diffsynth_core.errors import InputError, naming_the_place
from diffsynth_core.gradient import activation_offloader
from diffsynth_core.training.checkpoint import CheckpointManager
from diffsynth_core.training.device import avoid_broken_kernels, configure_determinism
from diffsynth_core.training.ema import swapped_weights
from diffsynth_core.training.experts import SIGMA_RANGE, ExpertModels, select_experts, trained_sigma_range
from diffsynth_core.training.guards import require_trained_weights
from diffsynth_core.training import optimizers
from diffsynth_core.training.batching import latent_shapes
from diffsynth_core.training.loop import Trainer, planned_steps
from diffsynth_core.training.sampler import BucketSampler

from .common import (family_of, init_distributed, is_main_process, leaving_process_group, load_components, model_dtype,
                     resolve_device)
from .config import RunConfig
from .exports import LoraExporter, check_lora_checkpoint, expert_stem, export_lora
from .identity import METADATA_KEY, base_model, check_resume_base
from .keys import empty_prompt_key, training_set
from .locks import output_lock
from .resume_rule import SAMPLES_KEY, SETTINGS_KEY, check_resume, refuse_fixed_changes, sample_record, settings
from .validation import ValidationRenderer, validation_references

log = logging.getLogger(__name__)


@dataclass
class TrainSummary:
    output: str
    steps: int
    resumed_from: int
    final_loss: float | None
    exports: dict[str, str]
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.resumed_from and self.resumed_from == self.steps:
            resumed = " (already complete: nothing to train, exports rewritten)"
        else:
            resumed = f" (resumed at step {self.resumed_from})" if self.resumed_from else ""
        loss = f", last loss {self.final_loss:.4f}" if self.final_loss is not None else ""
        files = ", ".join(self.exports.values())
        return f"train: {self.steps} steps{resumed}{loss} in {self.seconds:.1f}s -> {files}"


class CachedSamples:
    """The training set: cache entries in the order of the dataset keys, read on demand.

    ``latents``: each key's target-latents entry (``stages.keys.Plan``), read beside it; None where
    entries hold their own latents (an imported cache)."""

    def __init__(self, store, keys: list[str], latents: dict[str, str] | None = None):
        self.store, self.keys, self.latents = store, keys, latents or {}

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, Any]:
        key = self.keys[index]
        entry = self.store.get(key)
        if key not in self.latents:
            return entry
        target = self.store.get(self.latents[key])
        return {**target, **entry, "meta": {**target.get("meta", {}), **entry.get("meta", {})}}

    def latent_shape(self, index: int) -> tuple:
        """The entry's batch bucket, from the cache manifest (no tensor is read): its latent shape, then
        the shapes of its reference latents in order when it has any."""
        key = self.keys[index]
        shapes = self.store.shapes(key)
        latents = tuple(self.store.shapes(self.latents[key])["latents"] if key in self.latents else shapes["latents"])
        references = tuple(tuple(shapes[f"ref_latents_{i}"]) for i in range(len(shapes))
                           if f"ref_latents_{i}" in shapes)
        return (latents, *references) if references else latents


def planned_total(cfg: RunConfig, store, keys: list[str], rank: int = 0, world_size: int = 1,
                  latents: dict[str, str] | None = None) -> int:
    """Optimizer steps the run of ``cfg`` makes over ``keys`` (``planned_steps``; batches per epoch
    as the loop's sampler makes them, shapes read from the cache's manifest; ``latents``: training key ->
    its target-latents entry, see ``CachedSamples``)."""
    if cfg.train.max_steps:
        return planned_steps(cfg.train, 0)
    sampler = BucketSampler(latent_shapes(CachedSamples(store, keys, latents)), cfg.train.batch_size, cfg.train.drop_last,
                            cfg.dataset.repeat, cfg.train.seed, rank, world_size)
    return planned_steps(cfg.train, sampler.rounds_per_epoch)


def load_empty_prompt(cfg: RunConfig, store, text_fingerprint: str | None = None) -> dict[str, torch.Tensor] | None:
    """The cached empty prompt's tensors when caption dropout needs them (stage 1 encodes them once).

    Keyed by the config's text-encoder fingerprint (``Plan.text_fingerprint``), or, for an imported
    cache, by the fingerprint it records.  A dropped caption keeps the row's reference latents: only
    the prompt-side tensors become the empty prompt's, encoded without images (docs/datasets.md)."""
    if cfg.train.caption_dropout <= 0:
        return None
    key = empty_prompt_key(cfg, text_fingerprint or store.fingerprint)
    if not store.has(key):
        raise InputError(f"train.caption_dropout = {cfg.train.caption_dropout} needs the empty prompt's embedding, "
                         f"which cache {store.url} lacks: run `splitflow preprocess` once more (it encodes only that)")
    return {k: v for k, v in store.get(key).items() if isinstance(v, torch.Tensor)}


class EmptyPrompts:
    """Caption dropout's prompt for sample ``index``: its row's own empty prompt, encoded with its references
    where the family's prompt must hold them (``stages.keys.Plan.empty_keys``), else the shared one."""

    def __init__(self, store, keys: list[str], own: dict[str, str], shared: dict[str, torch.Tensor]):
        self.store, self.keys, self.own, self.shared = store, keys, own, shared

    def __call__(self, index: int) -> dict[str, torch.Tensor]:
        key = self.own.get(self.keys[index])
        if key is None:
            return self.shared
        return {k: v for k, v in self.store.get(key).items() if isinstance(v, torch.Tensor)}


def empty_prompts(cfg: RunConfig, found) -> dict[str, torch.Tensor] | EmptyPrompts | None:
    """What caption dropout trains on (``load_empty_prompt``, and the rows' own where the plan has them); refuses,
    before any training, a cache whose rows lack their own (encoded with caption dropout off)."""
    shared = load_empty_prompt(cfg, found.store, found.plan and found.plan.text_fingerprint)
    if found.empty_missing:
        row = next(iter(found.empty_missing))
        raise InputError(f"train.caption_dropout = {cfg.train.caption_dropout} needs each edit row's empty prompt "
                         f"encoded with its references, which cache {found.store.url} lacks for "
                         f"{len(found.empty_missing)} rows (first: data row {row + 1}): run `splitflow preprocess` "
                         f"once more (it encodes only those)")
    return EmptyPrompts(found.store, found.keys, found.empty, shared) if found.empty else shared


def load_transformer(cfg: RunConfig, spec: FamilySpec, experts: tuple[Expert, ...] = ()) -> torch.nn.Module:
    """The DiT to train: the family's transformer, the one expert trained, or several (``ExpertModels``)."""
    check_model_folder(spec, cfg.model.path)
    dtype = model_dtype(cfg)
    if len(experts) > 1:
        return ExpertModels(experts, load_components(cfg, spec, tuple(e.component for e in experts)))
    component = experts[0].component if experts else spec.transformer_component
    if cfg.model.transformer_file:
        config_dir = Path(cfg.model.path) / component
        transformer = spec.load_transformer_file(Path(cfg.model.transformer_file), config_dir, dtype)
    else:
        transformer = load_components(cfg, spec, (component,))[component]
    for key, apply in spec.transformer_options.items():  # e.g. model.zero_cond_t over the files' own
        if getattr(cfg.model, key, None) is not None:
            transformer = apply(transformer, getattr(cfg.model, key))
    return transformer


def _full_name(spec: FamilySpec) -> str:
    return f"{spec.transformer_component}.safetensors"


def _ema_name(path: Path) -> str:
    return f"{path.stem}_ema{path.suffix}"


def trained_experts(cfg: RunConfig, spec: FamilySpec) -> tuple[FamilySpec, tuple[Expert, ...], tuple[float, float]]:
    """``(spec, experts, sigma range)`` a run trains: the spec's experts at the folder's boundary, those
    ``train.experts`` (or ``train.sigma_range``) selects, and the sigmas drawn for them."""
    spec = with_folder_boundary(spec, cfg.model.path, cfg.model.boundary_ratio)
    experts = select_experts(spec, cfg.train.experts, cfg.train.sigma_range)
    return spec, experts, trained_sigma_range(experts, cfg.train.sigma_range)


def final_exports(cfg: RunConfig) -> list[Path]:
    """The files the end of a run writes, its last act: the diffusers LoRA (one per expert; or the full
    DiT), and its EMA twin."""
    _, experts, _ = trained_experts(cfg, family_of(cfg))
    if cfg.train.lora_rank <= 0:
        files = [cfg.output_dir / _full_name(family_of(cfg))]
    elif experts:
        files = [cfg.output_dir / f"{expert_stem(Path(DIFFUSERS_FILE).stem, e)}.safetensors" for e in experts]
    else:
        files = [cfg.output_dir / DIFFUSERS_FILE]
    return files + ([cfg.output_dir / _ema_name(f) for f in files] if cfg.train.ema_decay else [])


def _refuse_what_experts_lack(cfg: RunConfig, experts: tuple[Expert, ...], sigma_range) -> None:
    if cfg.train.lora_checkpoint:
        check_lora_checkpoint(cfg.train.lora_checkpoint, experts, sigma_range)
    names = ", ".join(e.component for e in experts)
    if experts and cfg.train.validation_prompts:  # the renderer places the DiT as `transformer` only
        raise InputError(f"train.validation_prompts: validation images are not rendered for expert runs ({names}) "
                         "yet; remove them and render with the exported LoRA files (docs/training.md)")
    if len(experts) < 2:
        return
    for key, is_set in (("train.lora_rank = 0 (full fine-tuning)", cfg.train.lora_rank <= 0),
                        ("model.transformer_file", bool(cfg.model.transformer_file)),
                        ("train.preset_lora_path", bool(cfg.train.preset_lora_path))):
        if is_set:
            raise InputError(f"{key} is not available when a run trains two experts ({names}): train LoRA "
                             "without it, or one expert per run (train.experts = [\"...\"])")


def _export(spec: FamilySpec, result, output: Path, learning_rate: float, experts: tuple[Expert, ...] = (),
            sigma_range=SIGMA_RANGE) -> dict[str, str]:
    if result.lora_config is not None:
        return export_lora(spec, result.model, result.lora_config, output, experts=experts, sigma_range=sigma_range,
                           learning_rate=learning_rate)
    weights = {k: v.detach().cpu().contiguous() for k, v in result.model.state_dict().items()}
    require_trained_weights(weights, f"export to {output}", learning_rate)
    path = output / _full_name(spec)
    save_file(weights, str(path))
    return {"full": str(path)}


def _export_ema(spec: FamilySpec, result, output: Path, learning_rate: float, experts: tuple[Expert, ...] = (),
                sigma_range=SIGMA_RANGE) -> dict[str, str]:
    """The EMA weights in the same formats, beside the raw files: ``lora.safetensors`` -> ``lora_ema.safetensors``."""
    staging = output / ".ema-export"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()  # the full-weights export writes into it as it is (LoRA exports make their folder)
    with swapped_weights(result.model, result.ema):
        written = _export(spec, result, staging, learning_rate, experts, sigma_range)
    exports = {}
    for kind, path in written.items():
        final = output / _ema_name(Path(path))
        os.replace(path, final)
        exports[f"{kind}_ema"] = str(final)
    shutil.rmtree(staging)
    return exports


def run(cfg: RunConfig) -> TrainSummary:
    with output_lock(cfg), leaving_process_group():  # one training per output folder: a second is refused
        return _train(cfg)


def _train(cfg: RunConfig) -> TrainSummary:
    started = time.perf_counter()
    spec, experts, sigma_range = trained_experts(cfg, family_of(cfg))
    _refuse_what_experts_lack(cfg, experts, sigma_range)
    if cfg.model.path:  # a folder of another family is named as such, before the cache (made by it) is blamed
        check_model_folder(spec, cfg.model.path)
    checkpoints = CheckpointManager(cfg.output_dir / "checkpoints")
    refuse_fixed_changes(cfg, checkpoints.latest_metadata(), str(checkpoints.latest_dir()))  # before any reading
    found = training_set(cfg)  # checked against the model, derived from the config
    store, keys = found.store, found.keys
    empty_prompt = empty_prompts(cfg, found)  # fails fast
    optimizers.checked_args(optimizers.optimizer_class(cfg.train.optimizer), cfg.train.optimizer,
                            cfg.train.optimizer_args)  # a misspelt argument too
    configure_determinism(cfg.train.deterministic, cfg.train.seed)
    device = init_distributed(avoid_broken_kernels(resolve_device(cfg.train.device, "train.device")))
    output = cfg.output_dir
    base = None
    if is_main_process():
        output.mkdir(parents=True, exist_ok=True)
        cfg.save(output / "config.toml")
        base = base_model(cfg, spec, () if cfg.model.transformer_file else tuple(e.component for e in experts))
        check_resume_base(checkpoints, base)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        check_resume(cfg, checkpoints.latest_metadata(), str(checkpoints.latest_dir()),
                     planned_total(cfg, store, keys, 0, world, found.latents), keys)
    transformer = load_transformer(cfg, spec, experts)
    samples = CachedSamples(store, keys, found.latents)
    callbacks = [LoraExporter(spec, output, cfg.output.export_every, experts, sigma_range, cfg.output.diffsynth_files)]
    if cfg.train.validation_prompts and keys:  # render at the size of the first training sample
        meta = samples[0]["meta"]
        callbacks.append(ValidationRenderer(cfg, spec, (meta["height"], meta["width"]), meta.get("num_frames", 1),
                                            references=validation_references(cfg, spec)))
    trainer = Trainer(spec, transformer, samples, cfg.train, cfg.offload, output,
                      device=device, repeat=cfg.dataset.repeat, callbacks=callbacks,
                      checkpoint_metadata={METADATA_KEY: base, SETTINGS_KEY: settings(cfg),
                                           SAMPLES_KEY: sample_record(keys)} if base else None,
                      empty_prompt=empty_prompt, sigma_range=None if sigma_range == SIGMA_RANGE else sigma_range)
    result = trainer.fit()
    report = result.offload.report() if result.offload is not None else {}  # planned vs measured bytes, GPU peak
    if result.host_state is not None:
        report["optimizer_state_on_host"] = result.host_state.stats
    if result.steps_in_backward is not None:
        report["optimizer_step_in_backward"] = result.steps_in_backward.stats
    offloader = activation_offloader(transformer)
    if offloader is not None and offloader.d2h_bytes:  # block inputs went to host memory (CUDA only)
        report["activation_offload"] = offloader.stats()
    trained = result.step > result.resumed_from  # a re-run of a finished run measured nothing
    if report and trained and trainer.rank == 0:
        (output / "offload.json").write_text(json.dumps(report, indent=1))
    if result.offload is not None and result.lora_config is None:
        result.offload.detach()  # full fine-tuning exports every weight: back in place, no second copy
    rate = cfg.train.learning_rate
    with naming_the_place("writing the final export in", str(output)):  # a full disk names the folder
        exports = _export(spec, result, output, rate, experts, sigma_range) if trainer.rank == 0 else {}
        if trainer.rank == 0 and result.ema is not None:
            exports.update(_export_ema(spec, result, output, rate, experts, sigma_range))
    if result.offload is not None and result.lora_config is not None:
        # The adapters were read with the engine attached: release the frozen base, never restore it
        # (restoring would hold a second host copy of the DiT at the very end of the run).
        result.offload.detach(restore_frozen=False)
    summary = TrainSummary(str(output), result.step, result.resumed_from,
                           result.losses[-1] if result.losses else None, exports, time.perf_counter() - started)
    log.info(summary.describe())
    return summary
