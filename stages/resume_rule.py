"""What may change when a run resumes from its checkpoint, and what may not: one table for every setting.

Every key of ``RunConfig`` has one :class:`Kind` in :data:`RULES` (a test checks none is left out).
Each checkpoint records the settings that matter (``SETTINGS_KEY``) and the samples it trained on
(``SAMPLES_KEY``); every verb that trains (``run``, ``train``, ``resume``, ``train --in-process``)
compares them with its config before any model loads:

* a setting that may not change is refused, one line naming the checkpoint's value and the config's
  (exit 2, never retried);
* a setting that may change takes effect from the resumed step, said in one notice line;
* an output that finished training with another config is refused, saying how to continue (raise the
  steps) and how to start anew (another output path), since nothing would train;
* a dataset that grew, shrank or changed since the checkpoint is named with its counts.

docs/trust.md ("Resuming with a changed setting") shows the table.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from diffsynth_core.errors import InputError

from .config import RunConfig

log = logging.getLogger(__name__)
SETTINGS_KEY = "settings"
SAMPLES_KEY = "samples"


class Kind(enum.Enum):
    FIXED = "may not change: it changes what the trained weights (or their steps) mean"
    CHANGES = "may change: takes effect from the resumed step"
    NUMERICS = "may change: takes effect from the resumed step; no longer bit for bit an uninterrupted run"
    STEPS = "may change: where the run ends (raise it to train on, never below the checkpoint's step)"
    DATASET = "may change: the samples are compared, and a changed set is named with counts"
    BASE = "may change: the base model is compared by content (refused if it differs)"
    RUNTIME = "may change: how or where the run runs, not what it trains"


F, C, N, S, D, B, R = (Kind.FIXED, Kind.CHANGES, Kind.NUMERICS, Kind.STEPS, Kind.DATASET, Kind.BASE, Kind.RUNTIME)

RULES: dict[str, Kind] = {
    # [dataset]: which samples train is compared by content (the cache keys), not by these keys
    "dataset.base_path": D, "dataset.metadata_path": D, "dataset.data_file_keys": D, "dataset.max_pixels": D,
    "dataset.height": D, "dataset.width": D, "dataset.num_frames": D, "dataset.skip_bad_samples": D,
    "dataset.background": D, "dataset.allow_external_paths": D, "dataset.caption_extension": D,
    "dataset.sources": D, "dataset.reference_pixels": D, "dataset.reference_size": D,
    "dataset.first_frame_reference": D,
    "dataset.repeat": F,  # an epoch's batches, which the checkpoint's epoch position counts
    # [model]
    "model.family": F, "model.variant": F,
    # what the DiT computes and which sigmas each expert serves
    "model.zero_cond_t": F, "model.boundary_ratio": F,
    "model.path": B, "model.transformer_file": B, "model.sources": B,
    "model.dtype": N,
    # [cache]: entries are checked against the encoders wherever the cache lives
    "cache.url": R, "cache.backend": R, "cache.storage_options": R,
    "cache.allow_partial": D,
    # [preprocess]: how stage 1 runs; max_sequence_length changes the encoded prompts (so the samples)
    "preprocess.parts": R, "preprocess.retries": R, "preprocess.device": R, "preprocess.commit_every": R,
    "preprocess.offload_encoders": R, "preprocess.batch_size": R, "preprocess.decode_workers": R,
    "preprocess.vram_budget_gb": R, "preprocess.vae_tiling": R, "preprocess.devices": R,
    "preprocess.max_sequence_length": D,
    # [train]
    "train.learning_rate": C, "train.weight_decay": C, "train.warmup_steps": C, "train.max_grad_norm": C,
    "train.seed": C, "train.timestep_sampling": C, "train.logit_mean": C, "train.logit_std": C,
    "train.shift": C, "train.loss_weighting": C, "train.caption_dropout": C, "train.ema_decay": C,
    "train.save_steps": C, "train.keep_checkpoints": C, "train.max_nonfinite_steps": C,
    "train.validation_prompts": C, "train.validation_steps": C, "train.validation_inference_steps": C,
    "train.max_steps": S, "train.num_epochs": S,
    "train.optimizer": F, "train.optimizer_args": F,  # the saved optimizer state was built by them
    "train.lora_rank": F, "train.lora_alpha": F, "train.lora_target_modules": F, "train.lora_init": F,
    "train.preset_lora_path": F, "train.lora_checkpoint": F, "train.trainable_models": F,
    "train.batch_size": F, "train.gradient_accumulation_steps": F, "train.drop_last": F,
    "train.experts": F, "train.sigma_range": F,  # which transformers train, on which sigmas
    "train.lora_narrow_inputs": N, "train.gradient_checkpointing": N, "train.gradient_checkpointing_offload": N,
    "train.device": N, "train.deterministic": N, "train.compile_blocks": N,
    "train.retries": R, "train.tensorboard": R,
    # [offload]: where weights wait; storage_dtype is the base the adapters learn against
    "offload.enable_model_cpu_offload": N, "offload.enable_optimizer_cpu_offload": N,
    "offload.optimizer_state_on_host": N, "offload.optimizer_step_in_backward": N,
    "offload.cpu_offload_split_threshold": R, "offload.vram_budget_gb": R, "offload.prefetch": R,
    "offload.granularity": R,
    "offload.storage_dtype": F,
    # [output]
    "output.path": R, "output.export_every": C, "output.diffsynth_files": R,
    # [orchestration]
    "orchestration.api_grace_s": R, "orchestration.retry_delay_s": R, "orchestration.heartbeat_s": R,
    "orchestration.stale_after_s": R, "orchestration.poll_s": R,
}
_COMPARED = (Kind.FIXED, Kind.CHANGES, Kind.NUMERICS, Kind.STEPS)


def config_keys() -> list[str]:
    """Every ``section.key`` of ``RunConfig``."""
    return [f"{section}.{key}" for section, field in RunConfig.model_fields.items()
            for key in field.annotation.model_fields]


def settings(cfg: RunConfig) -> dict[str, Any]:
    """{dotted key: value} of the settings a checkpoint records (JSON values, as compared on resume)."""
    dumped = cfg.model_dump(mode="json")
    values = {}
    for dotted, kind in RULES.items():
        if kind in _COMPARED:
            section, key = dotted.split(".")
            values[dotted] = dumped[section][key]
    return values


def sample_record(keys: Sequence[str]) -> dict[str, Any]:
    """What a checkpoint records of its training set: the count, and a digest of the keys in order."""
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
    return {"count": len(keys), "digest": digest}


def _changed(saved: dict[str, Any], cfg: RunConfig, kinds: tuple[Kind, ...]) -> list[tuple[str, Any, Any]]:
    now = settings(cfg)
    return [(key, saved[key], now[key]) for key, kind in RULES.items()
            if kind in kinds and key in saved and key in now and saved[key] != now[key]]


def _values(changes) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)


def refuse_fixed_changes(cfg: RunConfig, metadata: dict | None, where: str) -> None:
    """Refuse (exit 2) a config that changes a setting the checkpoint ``where`` fixes; a checkpoint
    written before settings were recorded passes with a warning."""
    if metadata is None:
        return
    saved = metadata.get(SETTINGS_KEY)
    if saved is None:
        log.warning("checkpoint %s records no settings (written by an older splitflow): resuming without "
                    "checking that the config trains what it trained", where)
        return
    fixed = _changed(saved, cfg, (Kind.FIXED,))
    if fixed:
        values = "; ".join(f"{key} was {old!r}, this config sets {new!r}" for key, old, new in fixed)
        raise InputError(f"cannot resume checkpoint {where}: {values}; these cannot change on resume (they change "
                         "what the trained weights mean): set them back to continue, or set output.path to another "
                         "folder to start anew")


def check_resume(cfg: RunConfig, metadata: dict | None, where: str, total_steps: int,
                 keys: Sequence[str] | None, notice: bool = True) -> None:
    """The whole rule for resuming checkpoint ``where`` (its ``metadata``) under ``cfg``, which plans
    ``total_steps`` over the samples ``keys`` (None: not known here).  Refuses what may not change and a
    finished output given another config; says in one line (``notice``) what changes from the resumed step."""
    refuse_fixed_changes(cfg, metadata, where)
    if metadata is None or SETTINGS_KEY not in metadata:
        return
    step = int(metadata.get("step", 0))
    saved = metadata[SETTINGS_KEY]
    changes = _changed(saved, cfg, (Kind.CHANGES, Kind.NUMERICS, Kind.STEPS))
    grown = _samples_changed(metadata.get(SAMPLES_KEY), keys)
    if total_steps < step:
        raise InputError(f"checkpoint {where} is at step {step}, past the {total_steps} steps this config plans "
                         f"({_values(changes) or 'train.max_steps / train.num_epochs'}): raise train.max_steps "
                         f"(or train.num_epochs) to at least {step}, or set output.path to another folder to "
                         "start anew")
    if total_steps == step:  # finished: nothing trains, so a changed setting would be silently ignored
        ignored = [c for c in changes if RULES[c[0]] in (Kind.CHANGES, Kind.STEPS)]
        if ignored or grown:
            what = "; ".join(filter(None, [_values(ignored), grown]))
            raise InputError(f"output {cfg.output_dir} finished training at step {step} (checkpoint {where}), "
                             f"and this config changes it ({what}): nothing would train with that. To continue "
                             f"with it from step {step}, raise train.max_steps (or train.num_epochs); to start "
                             "anew, set output.path to another folder")
        return
    if notice and (changes or grown):
        numerics = [key for key, _, _ in changes if RULES[key] == Kind.NUMERICS]
        tail = (f"; with {', '.join(numerics)} changed the run no longer ends bit for bit where an uninterrupted "
                "run would") if numerics else ""
        log.warning("resuming %s at step %d with %s: in effect from step %d%s", where, step,
                    "; ".join(filter(None, [_values(changes), grown])), step + 1, tail)


def _samples_changed(saved: dict | None, keys: Sequence[str] | None) -> str:
    """'' when the samples are those the checkpoint trained on (or either is unknown), else their counts."""
    if saved is None or keys is None:
        return ""
    now = sample_record(keys)
    if now == saved:
        return ""
    old, new = saved["count"], now["count"]
    if new > old:
        return f"the dataset grew from {old} to {new} samples ({new - old} added)"
    if new < old:
        return f"the dataset shrank from {old} to {new} samples ({old - new} removed)"
    return f"the dataset holds other samples than it did ({new}, as many as before: rows were edited)"
