"""LoRA files written during training, as DiffSynth-Studio writes ``epoch-K`` / ``step-N`` files.

``output.export_every`` chooses when: ``"epoch"`` after each epoch (K counts from 0, as in
DiffSynth), ``"save"`` at every checkpoint (``train.save_steps`` and the last step), ``"end"``
never (only the final ``lora*.safetensors``).  Each export is the same set of files as the final
one (one per consumer, docs/lora_files.md) under ``<output>/loras/``; full fine-tuning exports
nothing here (its weights are in the checkpoints).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from diffsynth_core.models import FamilySpec
from diffsynth_core.training.guards import require_trained_weights
from diffsynth_core.training.lora import lora_state_dict

log = logging.getLogger(__name__)


def export_lora(spec: FamilySpec, model: torch.nn.Module, lora_config: dict[str, Any], folder: Path,
                stem: str = "lora", learning_rate: float | None = None) -> dict[str, str]:
    """Write the LoRA of ``model`` as ``folder/<stem>*.safetensors``; consumer -> path.

    A NaN or absurdly large LoRA (a diverged run, ``learning_rate`` named in the line) is never written."""
    weights = lora_state_dict(model)
    require_trained_weights(weights, f"LoRA export to {folder}", learning_rate)
    paths = spec.export_lora(weights, lora_config, folder, stem=stem)
    return {consumer: str(path) for consumer, path in paths.items()}


class LoraExporter:
    """A training callback (see ``Trainer``) writing the LoRA at epoch ends or checkpoint saves."""

    def __init__(self, spec: FamilySpec, output_dir: Path, every: str, diffsynth_files: bool = False):
        self.spec, self.folder, self.every = spec, Path(output_dir) / "loras", every
        # DiffSynth-Studio's own names beside the output (its ModelLogger.save_model: <output_path>/epoch-K)
        self.diffsynth_folder = Path(output_dir) if diffsynth_files else None

    def __call__(self, step: int, model: torch.nn.Module) -> None:
        """Nothing per step: exports follow epochs or checkpoints."""

    def on_epoch_end(self, epoch: int, step: int, model: torch.nn.Module, lora_config: dict | None) -> None:
        if self.every == "epoch":
            self._export(f"epoch-{epoch}", model, lora_config)

    def on_checkpoint(self, step: int, model: torch.nn.Module, lora_config: dict | None) -> None:
        if self.every == "save":
            self._export(f"step-{step}", model, lora_config)

    def _export(self, stem: str, model: torch.nn.Module, lora_config: dict | None) -> None:
        if lora_config is None:
            return
        paths = export_lora(self.spec, model, lora_config, self.folder, stem)
        if self.diffsynth_folder is not None and "diffsynth" in paths:
            own = self.diffsynth_folder / f"{stem}.safetensors"
            paths["diffsynth_own"] = str(_copied(Path(paths["diffsynth"]), own))
        log.info("LoRA exported: %s", ", ".join(paths.values()))


def _copied(source: Path, target: Path) -> Path:
    """``source`` copied to ``target`` through a temporary file: a reader sees the old file or the new one."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)
    return target
