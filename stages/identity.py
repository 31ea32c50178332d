"""The base model a training run builds on, recorded in every checkpoint and checked on resume.

A LoRA (or a fine-tuned DiT) only means something on the weights it was trained on.  The base
is identified by content: the transformer's files (or ``model.transformer_file``) and a preset
LoRA fused into it.  Digests are remembered across runs (``cache_store.digests``), so this is
cheap after the first run on a machine.  What else a resume may change: ``stages.resume_rule``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cache_store.digests import file_digest
from cache_store.keys import fingerprint_of
from diffsynth_core.errors import InputError
from diffsynth_core.models import FamilySpec
from diffsynth_core.training.checkpoint import CheckpointManager

from .common import component_digests
from .config import RunConfig

log = logging.getLogger(__name__)
METADATA_KEY = "base_model"


def base_model(cfg: RunConfig, spec: FamilySpec, experts: tuple[str, ...] = ()) -> dict:
    """{"fingerprint", "path"}: what the checkpoint records about the weights it trains on
    (``experts``: the components trained instead of the transformer, each identified)."""
    fused = cfg.train.preset_lora_path
    preset = file_digest(_named_file(fused, "train.preset_lora_path")) if fused else None
    if experts:
        files = {name: component_digests(cfg, spec, name) for name in experts}
        content = {"family": spec.name, "experts": files, "preset_lora": preset}
        label = " + ".join(str(Path(cfg.model.path) / name) for name in experts)
        return {"fingerprint": fingerprint_of(content), "path": label + (f" + preset LoRA {fused}" if fused else "")}
    if cfg.model.transformer_file:
        path = _named_file(cfg.model.transformer_file, "model.transformer_file")
        files = {path.name: file_digest(path)}
    else:
        path = Path(cfg.model.path) / spec.transformer_component
        files = component_digests(cfg, spec, spec.transformer_component)
    content = {"family": spec.name, "transformer": files, "preset_lora": preset}
    label = str(path) + (f" + preset LoRA {fused}" if fused else "")
    return {"fingerprint": fingerprint_of(content), "path": label}


def _named_file(value: str, key: str) -> Path:
    """The file a config key names; a missing one is the user's input (one line, exit 2), not a bug."""
    path = Path(value)
    if not path.is_file():
        raise InputError(f"{key}: {path} is not a file" + ("" if path.exists() else " (it does not exist)"))
    return path


def check_resume_base(checkpoints: CheckpointManager, base: dict) -> None:
    """Refuse to resume a checkpoint trained on another base model (exit code 2), naming both."""
    metadata = checkpoints.latest_metadata()
    if metadata is None:
        return
    saved = metadata.get(METADATA_KEY)
    if saved is None:
        log.warning("checkpoint %s records no base model (written by an older splitflow): resuming "
                    "without checking it was trained on %s", checkpoints.latest_dir(), base["path"])
        return
    if saved.get("fingerprint") != base["fingerprint"]:
        raise InputError(
            f"checkpoint {checkpoints.latest_dir()} was trained on base model {saved.get('path')} (fingerprint "
            f"{saved.get('fingerprint')}), but this config's base model is {base['path']} (fingerprint "
            f"{base['fingerprint']}); set output.path to a new folder, or restore that base model")
