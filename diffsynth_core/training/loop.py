"""The training loop: flow-matching steps over cached samples, with exact resume.

A run is a pure function of its config and the cache: the sample order comes from
``ResumableSampler``, noise and timesteps from a generator seeded by each draw's serial, and a checkpoint holds
every piece of state that changes (weights, optimizer, scheduler, sampler position, RNGs).
So N steps, a kill, and a resume to 2N steps end bit-for-bit where 2N uninterrupted steps do.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.base import FamilySpec
from .checkpoint import CheckpointManager
from .flow_matching import flow_matching_loss, loss_weight, noisy_latents, sample_sigmas, velocity_target
from .metrics import MetricsLog
from .prepare import Prepared, prepare_for_training
from .sampler import ResumableSampler, SamplerState
from ..errors import InputError

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    model: nn.Module
    lora_config: dict[str, Any] | None
    step: int
    resumed_from: int
    losses: list[float] = field(default_factory=list)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _to_batch(entry: Mapping[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Add the batch dim and move every tensor; floating tensors take the model's dtype."""
    batch = {}
    for key, value in entry.items():
        if isinstance(value, torch.Tensor):
            value = value.unsqueeze(0).to(device)
            batch[key] = value.to(dtype) if value.is_floating_point() else value
    return batch


class Trainer:
    """Train ``model`` (the family's DiT) on ``samples`` (cache entries with a ``latents`` key)."""

    def __init__(self, spec: FamilySpec, model: nn.Module, samples: Sequence[Mapping[str, Any]], train, offload,
                 output_dir: Path | str, device: torch.device | str = "cpu", repeat: int = 1, progress: bool = True,
                 callbacks: Sequence[Callable[[int, nn.Module], None]] = (),
                 checkpoint_metadata: Mapping[str, Any] | None = None):
        self.spec, self.model, self.samples = spec, model, samples
        self.train, self.offload_opts = train, offload
        self.output_dir, self.device = Path(output_dir), torch.device(device)
        self.repeat, self.progress = repeat, progress
        self.callbacks = list(callbacks)  # called on rank 0 after each optimizer step: fn(step, model)
        self.checkpoint_metadata = dict(checkpoint_metadata or {})  # saved with every checkpoint (base model)
        self.rank, self.world_size = _world()
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", keep=train.keep_checkpoints)

    # -- public verbs --------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        if getattr(self.train, "batch_size", 1) != 1:
            raise InputError("train.batch_size > 1 is not supported by this version; "
                             "use train.gradient_accumulation_steps")
        prepared = prepare_for_training(self.model, self.spec, self.train, self.offload_opts, self.device)
        sampler = ResumableSampler(len(self.samples), self.repeat, self.train.seed, self.rank, self.world_size)
        step = self._resume(prepared, sampler)
        resumed_from, total = step, self.total_steps(sampler)
        metrics = self._open_metrics(step)
        losses: list[float] = []
        bar = self._progress_bar(step, total)
        while step < total:
            started = time.perf_counter()
            loss = self._optimizer_step(prepared, sampler)
            step += 1
            elapsed = time.perf_counter() - started
            losses.append(loss)
            if metrics is not None:
                samples_per_step = self.train.gradient_accumulation_steps * self.world_size
                metrics.log(step=step, epoch=sampler.state.epoch, loss=f"{loss:.6g}",
                            lr=f"{prepared.scheduler.get_last_lr()[0]:.6g}", step_time_s=f"{elapsed:.4f}",
                            samples_per_s=f"{samples_per_step / elapsed:.3f}")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
            if step == total or (self.train.save_steps and step % self.train.save_steps == 0):
                self._save(prepared, sampler, step)
            if self.rank == 0:
                for callback in self.callbacks:
                    callback(step, prepared.model)
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        if prepared.offload is not None:
            prepared.offload.detach()  # real weights back in the module for export
        return TrainResult(prepared.model, prepared.lora_config, step, resumed_from, losses)

    def total_steps(self, sampler: ResumableSampler) -> int:
        if self.train.max_steps:
            return self.train.max_steps
        per_step = self.train.gradient_accumulation_steps
        return max(1, -(-self.train.num_epochs * sampler.samples_per_epoch // per_step))

    # -- one optimizer step --------------------------------------------------------------------
    def _optimizer_step(self, prepared: Prepared, sampler: ResumableSampler) -> float:
        accumulation = self.train.gradient_accumulation_steps
        total_loss = 0.0
        for _ in range(accumulation):
            index, serial = sampler.next_index()
            # Noise and timestep depend only on (seed, draw serial): resumable and world-size independent.
            generator = torch.Generator().manual_seed(self.train.seed * 1_000_003 + serial)
            loss = self._sample_loss(prepared.model, self.samples[index], generator) / accumulation
            loss.backward()
            total_loss += loss.item()
        params = list(prepared.trainable.values())
        if prepared.offload is not None:
            prepared.offload.after_backward()  # also all-reduces across ranks
        elif self.world_size > 1:
            _all_reduce_mean(params)
        if self.train.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm)
        prepared.optimizer.step()
        prepared.scheduler.step()
        prepared.optimizer.zero_grad(set_to_none=True)
        return total_loss

    def _sample_loss(self, model: nn.Module, entry: Mapping[str, Any], generator: torch.Generator) -> torch.Tensor:
        dtype = getattr(model, "dtype", torch.float32)
        batch = _to_batch(entry, self.device, dtype)
        x0 = batch.pop("latents")
        # Draw on the CPU generator so the run is identical on any device.
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(self.device, x0.dtype)
        sigmas = sample_sigmas(1, self.train.timestep_sampling, generator, logit_mean=self.train.logit_mean,
                               logit_std=self.train.logit_std, shift=self.train.shift,
                               num_tokens=x0[0, 0].numel() // 4).to(self.device)
        prediction = self.spec.dit_forward(model, noisy_latents(x0, noise, sigmas), sigmas, batch)
        weights = loss_weight(sigmas, self.train.loss_weighting)
        return flow_matching_loss(prediction, velocity_target(x0, noise), weights)

    # -- checkpoints ---------------------------------------------------------------------------
    def _save(self, prepared: Prepared, sampler: ResumableSampler, step: int) -> None:
        if self.rank != 0:
            return
        state = {
            "step": step,
            "epoch": sampler.state.epoch,
            "position": sampler.state.position,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
        }
        optimizer_state = {"optimizer": prepared.optimizer.state_dict(), "scheduler": prepared.scheduler.state_dict()}
        metadata = {**self.checkpoint_metadata, "lora_config": prepared.lora_config, "family": self.spec.name,
                    "step": step}
        path = self.checkpoints.save(step, dict(prepared.trainable), optimizer_state, state, metadata)
        log.info("checkpoint written: %s", path)

    def _resume(self, prepared: Prepared, sampler: ResumableSampler) -> int:
        checkpoint = self.checkpoints.load()
        if checkpoint is None:
            return 0
        saved = checkpoint["weights"]
        missing = sorted(set(prepared.trainable) - set(saved))
        if missing:
            raise InputError(f"checkpoint {checkpoint['path']} lacks trainable parameters {missing[:5]} "
                               f"({len(missing)} in all): it was written by a different LoRA/model setup")
        with torch.no_grad():
            for name, param in prepared.trainable.items():
                param.copy_(saved[name])
        prepared.optimizer.load_state_dict(checkpoint["optimizer"]["optimizer"])
        prepared.scheduler.load_state_dict(checkpoint["optimizer"]["scheduler"])
        state = checkpoint["state"]
        sampler.state = SamplerState(state["epoch"], state["position"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])
        log.info("resumed from %s (step %d)", checkpoint["path"], state["step"])
        return state["step"]

    # -- reporting -----------------------------------------------------------------------------
    def _open_metrics(self, step: int) -> MetricsLog | None:
        if self.rank != 0:
            return None
        tensorboard_dir = self.output_dir / "tensorboard" if self.train.tensorboard else None
        return MetricsLog(self.output_dir / "metrics.csv", resume_step=step, tensorboard_dir=tensorboard_dir)

    def _progress_bar(self, step: int, total: int):
        if not self.progress or self.rank != 0:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=step, desc="train", unit="step")


def _all_reduce_mean(params: list[nn.Parameter]) -> None:
    world = dist.get_world_size()
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)
        param.grad /= world
