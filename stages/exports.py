"""LoRA files written during training, as DiffSynth-Studio writes ``epoch-K`` / ``step-N`` files.

``output.export_every`` chooses when: ``"epoch"`` after each epoch (K counts from 0, as in
DiffSynth), ``"save"`` at every checkpoint (``train.save_steps`` and the last step), ``"end"``
never (only the final ``lora*.safetensors``).  Each export is the same set of files as the final
one (one per consumer, docs/lora_files.md) under ``<output>/loras/``; full fine-tuning exports
nothing here (its weights are in the checkpoints).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from diffsynth_core.errors import InputError
from diffsynth_core.models import Expert, FamilySpec
from diffsynth_core.models.lora_export import write_safetensors
from diffsynth_core.training.experts import SIGMA_RANGE, ExpertModels
from diffsynth_core.training.guards import require_trained_weights
from diffsynth_core.training.lora import lora_state_dict

log = logging.getLogger(__name__)

# Header entries naming what a LoRA file was trained on (read back by check_lora_checkpoint).
EXPERT_KEY, SIGMA_RANGE_KEY = "splitflow_expert", "splitflow_sigma_range"


def expert_stem(stem: str, expert: Expert) -> str:
    """``lora`` -> ``lora_high_noise``: one set of files per expert."""
    return f"{stem}_{expert.label or expert.component}"


def export_lora(spec: FamilySpec, model: torch.nn.Module, lora_config: dict[str, Any], folder: Path,
                stem: str = "lora", experts: Sequence[Expert] = (),
                sigma_range: Sequence[float] = SIGMA_RANGE, learning_rate: float | None = None) -> dict[str, str]:
    """Write the LoRA of ``model`` as ``folder/<stem>*.safetensors``; consumer -> path.

    Several experts (``ExpertModels``) give one set per expert, ``<stem>_<label>*`` (consumer keys
    ``diffusers_<label>``, ...); a run of one expert of several (``experts``) names its files the same
    way.  Each file records its expert and the sigmas it trained on in its header.  A NaN or absurdly
    large LoRA (a diverged run, ``learning_rate`` named in the line) is never written."""
    weights = lora_state_dict(model)
    require_trained_weights(weights, f"LoRA export to {folder}", learning_rate)
    if isinstance(model, ExpertModels):
        exports = {}  # peft's adapter config is the container's
        for expert in model.experts:
            prefix = expert.component + "."
            own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
            served = (max(expert.sigma_min, sigma_range[0]), min(expert.sigma_max, sigma_range[1]))
            written = _export_one(spec, own, lora_config, folder, expert_stem(stem, expert), expert, served)
            exports.update({f"{consumer}_{expert.label or expert.component}": path
                            for consumer, path in written.items()})
        return exports
    expert = experts[0] if len(experts) == 1 else None
    return _export_one(spec, weights, lora_config, folder,
                       expert_stem(stem, expert) if expert else stem, expert, tuple(sigma_range))


def _export_one(spec: FamilySpec, weights: dict[str, torch.Tensor], lora_config: dict[str, Any], folder: Path,
                stem: str, expert: Expert | None, sigma_range: tuple[float, float]) -> dict[str, str]:
    paths = spec.export_lora(weights, lora_config, folder, stem=stem)
    marks = {} if expert is None else {EXPERT_KEY: expert.component}
    if tuple(sigma_range) != SIGMA_RANGE:
        marks[SIGMA_RANGE_KEY] = json.dumps([float(v) for v in sigma_range])
    if marks:
        for path in paths.values():
            _add_header_entries(Path(path), marks)
    return {consumer: str(path) for consumer, path in paths.items()}


def _add_header_entries(path: Path, entries: dict[str, str]) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        metadata = dict(handle.metadata() or {})
    write_safetensors(path, tensors, {**metadata, **entries})


def check_lora_checkpoint(path: str | Path, experts: Sequence[Expert], sigma_range: Sequence[float]) -> None:
    """``train.lora_checkpoint`` must be a LoRA of the expert this run trains: a file whose header names
    another expert, or sigmas that do not meet the run's, is refused (one line, exit 2)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        return  # loading it names the missing file
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    if len(experts) > 1:
        raise InputError(f"train.lora_checkpoint {path}: this run trains {len(experts)} experts "
                         f"({', '.join(e.component for e in experts)}) and one file continues one; set "
                         "train.experts to the one the file belongs to")
    trained = metadata.get(EXPERT_KEY)
    if experts and trained is not None and trained != experts[0].component:
        raise InputError(f"train.lora_checkpoint {path} is a LoRA of expert {trained!r}, but this run trains "
                         f"{experts[0].component!r}: give that expert's file, or set train.experts = [{trained!r}]")
    if SIGMA_RANGE_KEY in metadata:
        low, high = json.loads(metadata[SIGMA_RANGE_KEY])
        if not (low < sigma_range[1] and sigma_range[0] < high):
            raise InputError(f"train.lora_checkpoint {path} was trained on sigmas [{low:g}, {high:g}] (another "
                             f"expert), this run draws [{sigma_range[0]:g}, {sigma_range[1]:g}]: give the LoRA of "
                             "the expert this run trains")


class LoraExporter:
    """A training callback (see ``Trainer``) writing the LoRA at epoch ends or checkpoint saves."""

    def __init__(self, spec: FamilySpec, output_dir: Path, every: str, experts: Sequence[Expert] = (),
                 sigma_range: Sequence[float] = SIGMA_RANGE, diffsynth_files: bool = False):
        self.spec, self.folder, self.every = spec, Path(output_dir) / "loras", every
        self.experts, self.sigma_range = tuple(experts), tuple(sigma_range)
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
        paths = export_lora(self.spec, model, lora_config, self.folder, stem, self.experts, self.sigma_range)
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
