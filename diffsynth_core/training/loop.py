"""The training loop: flow-matching steps over batches of cached samples, with exact resume.

A run is a pure function of its config and the cache: the batches come from ``BucketSampler``
(samples of one latent shape per batch), each sample's noise, timestep and caption dropout from a
generator seeded by its draw serial, and a checkpoint holds every piece of state that changes
(weights, optimizer, scheduler, EMA, sampler position, RNGs).  So N steps, a kill, and a resume to
2N steps end bit-for-bit where 2N uninterrupted steps do.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..models.base import FamilySpec
from .batching import latent_shapes, sequence_shape, stack_entries, to_device, with_empty_prompt
from .checkpoint import CheckpointManager
from .collector import frozen_heap
from .ema import EmaWeights
from .experts import drop_idle_gradients, experts_that_ran, predict
from .flow_matching import flow_matching_loss, loss_weight, noisy_latents, sample_sigmas, velocity_target
from .guards import GradientCoverage, NonFiniteGuard, exclude_from_optimizer, grad_norm
from .metrics import MetricsLog
from .prefetch import HostBatch, NextBatch
from .prepare import Prepared, prepare_for_training
from .sampler import Batch, BucketSampler, SamplerState, format_bucket
from ..errors import InputError

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    model: nn.Module
    lora_config: dict[str, Any] | None
    step: int
    resumed_from: int
    losses: list[float] = field(default_factory=list)
    ema: dict[str, torch.Tensor] | None = None  # EMA of the trainable weights by name (train.ema_decay)
    # Under offload the engine stays attached, so an export can read the adapters without
    # restoring the frozen base; ``offload.detach()`` gives the model back (in place).
    offload: Any = None
    host_state: Any = None  # HostOptimizerState (offload.optimizer_state_on_host): its ``stats``
    steps_in_backward: Any = None  # StepInBackward (offload.optimizer_step_in_backward): its ``stats``


@dataclass
class StepResult:
    loss: float
    batches: list[Batch]  # every batch of the step, all ranks and accumulation rounds


@dataclass(frozen=True)
class Schedule:
    """The resolved timestep sampling and loss weighting ("auto" = the family's default)."""
    sampling: str
    weighting: str
    template: str | None  # the family's DiffSynth template, for "diffsynth"

    @classmethod
    def resolve(cls, train, spec: FamilySpec) -> "Schedule":
        sampling = spec.default_timestep_sampling if train.timestep_sampling == "auto" else train.timestep_sampling
        weighting = spec.default_loss_weighting if train.loss_weighting == "auto" else train.loss_weighting
        if "diffsynth" in (sampling, weighting) and spec.diffsynth_template is None:
            raise InputError(f"train.timestep_sampling/loss_weighting 'diffsynth': family {spec.name} "
                             "declares no DiffSynth schedule; choose another scheme")
        return cls(sampling, weighting, spec.diffsynth_template)


def planned_steps(train, rounds_per_epoch: int) -> int:
    """Optimizer steps a run makes: ``train.max_steps``, else its epochs of ``rounds_per_epoch`` batches.

    One function, so the loop and ``stages.status`` (what is left to do) always agree.
    """
    if train.max_steps:
        return train.max_steps
    per_step = train.gradient_accumulation_steps
    return max(1, -(-train.num_epochs * rounds_per_epoch // per_step))


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    """Train ``model`` (the family's DiT) on ``samples`` (cache entries with a ``latents`` key).

    ``empty_prompt``: the cached empty prompt's tensors, which ``train.caption_dropout`` trains on; or a
    callable giving them for a sample's index (rows whose empty prompt holds their references).
    """

    def __init__(self, spec: FamilySpec, model: nn.Module, samples: Sequence[Mapping[str, Any]], train, offload,
                 output_dir: Path | str, device: torch.device | str = "cpu", repeat: int = 1, progress: bool = True,
                 callbacks: Sequence[Callable[[int, nn.Module], None]] = (),
                 checkpoint_metadata: Mapping[str, Any] | None = None,
                 empty_prompt: Mapping[str, torch.Tensor] | Callable[[int], Mapping[str, torch.Tensor]] | None = None,
                 sigma_range: tuple[float, float] | None = None):
        self.spec, self.model, self.samples = spec, model, samples
        self.train, self.offload_opts = train, offload
        self.output_dir, self.device = Path(output_dir), torch.device(device)
        self.repeat, self.progress = repeat, progress
        # Called on rank 0 after each optimizer step: fn(step, model).  A callback may also define
        # on_checkpoint(step, model, lora_config) and on_epoch_end(epoch, step, model, lora_config).
        # Under optimizer offload the host weights may still be stepping when fn runs (running the
        # model waits for them; a sync every step would stall the next forward): read trainable
        # weights directly only in the two hooks, which run after offload.sync().
        self.callbacks = list(callbacks)
        self.checkpoint_metadata = dict(checkpoint_metadata or {})  # saved with every checkpoint (base model)
        self.rank, self.world_size = _world()
        self.checkpoints = CheckpointManager(self.output_dir / "checkpoints", keep=train.keep_checkpoints)
        self.schedule = Schedule.resolve(train, spec)
        if train.caption_dropout > 0 and empty_prompt is None:
            raise InputError("train.caption_dropout > 0 needs the empty prompt's embedding from the cache; "
                             "run preprocess again (it encodes only that)")
        self.empty_prompt = empty_prompt
        # The sigmas drawn (None: all of (0, 1]); one expert of several trains only its own (experts.py).
        self.sigma_range = sigma_range
        self.nonfinite = NonFiniteGuard(getattr(train, "max_nonfinite_steps", 3), train.learning_rate)
        self.no_gradient: list[str] | None = None  # trainable names that get no gradient; None: not known yet
        # Watches gradients until every expert has had a step (an idle expert's LoRA is not unused).
        self._coverage: GradientCoverage | None = None
        self._experts_seen: set[str] = set()
        self.next_batch = NextBatch(self._host_batch)  # read while the GPU computes the round before
        self._dtype_of: tuple[nn.Module, torch.dtype] | None = None  # see _input_dtype

    # -- public verbs --------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        largest = max((sequence_shape(bucket) for bucket in latent_shapes(self.samples)), key=math.prod)
        prepared = prepare_for_training(self.model, self.spec, self.train, self.offload_opts, self.device, largest)
        sampler = self.make_sampler()
        ema = self._make_ema(prepared)
        step = self._resume(prepared, sampler, ema)
        resumed_from, total = step, self.total_steps(sampler)
        metrics = self._open_metrics(step)
        losses: list[float] = []
        bar = self._progress_bar(step, total)
        epochs_done = _epochs_completed(sampler)
        with frozen_heap():  # no full collection pauses a step (collector.py)
            while step < total:
                started = time.perf_counter()
                result = self.optimizer_step(prepared, sampler, step + 1, prefetch=step + 1 < total)
                if ema is not None:
                    ema.update(prepared.trainable)
                step += 1
                losses.append(result.loss)
                self._report(metrics, bar, step, sampler, prepared, result, time.perf_counter() - started)
                saving = step == total or (self.train.save_steps and step % self.train.save_steps == 0)
                ended = range(epochs_done, _epochs_completed(sampler))
                if prepared.offload is not None and (saving or ended):
                    prepared.offload.sync()  # checkpoints and exports read the weights: queued host steps first
                if saving:
                    self._save(prepared, sampler, step, ema)
                    self._notify("on_checkpoint", step, prepared.model, prepared.lora_config)
                for epoch in ended:
                    self._notify("on_epoch_end", epoch, step, prepared.model, prepared.lora_config)
                epochs_done = _epochs_completed(sampler)
                self._notify("__call__", step, prepared.model)
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        averaged = ema.state_dict() if ema is not None else None
        return TrainResult(prepared.model, prepared.lora_config, step, resumed_from, losses, averaged,
                           offload=prepared.offload, host_state=prepared.host_state,
                           steps_in_backward=prepared.steps_in_backward)

    def make_sampler(self, batch_size: int | None = None) -> BucketSampler:
        """The run's batch order (``batch_size`` overrides ``train.batch_size``: benchmarks)."""
        sampler = BucketSampler(latent_shapes(self.samples), batch_size or self.train.batch_size,
                                self.train.drop_last, self.repeat, self.train.seed, self.rank, self.world_size)
        if self.rank == 0:
            log.info("batches per epoch (batch_size %d, drop_last %s):\n%s", sampler.batch_size,
                     self.train.drop_last, sampler.describe())
        return sampler

    def total_steps(self, sampler: BucketSampler) -> int:
        return planned_steps(self.train, sampler.rounds_per_epoch)

    # -- one optimizer step --------------------------------------------------------------------
    def optimizer_step(self, prepared: Prepared, sampler: BucketSampler, step: int = 0,
                       prefetch: bool = True) -> StepResult:
        """One optimizer step over ``gradient_accumulation_steps`` rounds; ``step`` (1-based) names it in messages.
        ``prefetch``: a step follows, so its first batch is read while this one's last round computes."""
        accumulation = self.train.gradient_accumulation_steps
        coverage = self._coverage or (GradientCoverage(prepared.trainable) if self.no_gradient is None else None)
        total_loss, batches = 0.0, []
        for i in range(accumulation):
            round_ = sampler.next_round()
            loss = self._batch_loss(prepared.model, self.next_batch.take(round_[self.rank])) / accumulation
            if prepared.steps_in_backward is not None:  # a NaN/Inf loss skips every page's step
                prepared.steps_in_backward.watch_loss(loss)
            loss.backward()
            if prefetch or i + 1 < accumulation:  # before the wait for the GPU below (prefetch.py)
                self.next_batch.prepare_ahead(sampler.peek_round()[self.rank])
            total_loss += loss.item()
            batches.extend(round_)
        ran = experts_that_ran(prepared.model, self.device)  # None: one transformer
        self._experts_seen |= ran or set()
        if coverage is not None:  # first step (every expert's first): leave out what can never learn
            self._coverage = coverage if ran is not None and not _all_experts(prepared.model, self._experts_seen) \
                else None
            if self._coverage is None:
                self._exclude(prepared, coverage.finish(self.device))
        params = list(prepared.trainable.values())
        if prepared.offload is not None:
            prepared.offload.after_backward()  # also all-reduces across ranks
        elif self.world_size > 1:
            _all_reduce_mean(params)
        if ran is not None:  # an expert no rank ran keeps its LoRA and moments as they are
            drop_idle_gradients(prepared.model, ran)
        if prepared.steps_in_backward is not None:
            self._stepped_in_backward(prepared, step, total_loss)
        else:
            norm = grad_norm(params, self.train.max_grad_norm)
            if self.nonfinite.allows_update(step, total_loss, norm, self.device):  # NaN/Inf: no update
                prepared.optimizer.step()
                prepared.scheduler.step()
        prepared.optimizer.zero_grad(set_to_none=True)
        return StepResult(total_loss, batches)

    def _stepped_in_backward(self, prepared: Prepared, step: int, loss: float) -> None:
        """The weights stepped page by page during backward; a page whose gradients (or the loss) held
        NaN/Inf skipped its step, and the step counts as non-finite (``train.max_nonfinite_steps``)."""
        pager = prepared.steps_in_backward
        skipped = pager.take_skipped()
        gradients = f"NaN/Inf gradients in {skipped} of {len(pager.pages)} pages, which kept their weights" \
            if skipped else None
        allowed = self.nonfinite.allows_update(step, loss, None, self.device, gradients=gradients)
        prepared.optimizer.step()  # every step: it closes the pager's cycle (no gradient is left to apply)
        if allowed:
            prepared.scheduler.step()

    def _host_batch(self, batch: Batch) -> HostBatch:
        """``batch`` read, drawn and stacked on the host (pinned when it goes to a GPU)."""
        draws = [self._draw(index, serial) for index, serial in zip(batch.indices, batch.serials)]
        host = HostBatch(stack_entries([entry for entry, _, _ in draws], self.spec.batch_padding),
                         torch.stack([noise for _, noise, _ in draws]), torch.cat([sigma for _, _, sigma in draws]))
        return host.pinned() if self.device.type == "cuda" else host

    def _batch_loss(self, model: nn.Module, host: HostBatch) -> torch.Tensor:
        pinned = self.device.type == "cuda"
        inputs = to_device(host.inputs, self.device, self._input_dtype(model), non_blocking=pinned)
        x0 = inputs.pop("latents")
        noise = host.noise.to(self.device, non_blocking=pinned).to(x0.dtype)  # cast on the device, as inputs are
        sigmas = host.sigmas.to(self.device, non_blocking=pinned)
        prediction = predict(self.spec.dit_forward, model, noisy_latents(x0, noise, sigmas), sigmas, inputs)
        weights = loss_weight(sigmas, self.schedule.weighting, self.schedule.template)
        return flow_matching_loss(prediction, velocity_target(x0, noise), weights)

    def _input_dtype(self, model: nn.Module) -> torch.dtype:
        """The dtype ``model`` takes its inputs in, read once per model: diffusers' ``ModelMixin.dtype``
        walks every submodule (9,500 with LoRA on Qwen-Image's 60 blocks: 14 ms of idle GPU at each
        step's start on the H200, ``bench/step_start.py`` at 8b1d56c)."""
        if self._dtype_of is None or self._dtype_of[0] is not model:
            self._dtype_of = (model, getattr(model, "dtype", torch.float32))
        return self._dtype_of[1]

    def _exclude(self, prepared: Prepared, names: list[str]) -> None:
        """Trainable tensors that get no gradient stay out of the optimizer (recorded in checkpoints)."""
        self.no_gradient = [name for name in names if name in prepared.trainable]
        exclude_from_optimizer(prepared.optimizer, [prepared.trainable[name] for name in self.no_gradient])

    def _draw(self, index: int, serial: int) -> tuple[Mapping[str, Any], torch.Tensor, torch.Tensor]:
        """Sample ``index`` with its noise, sigma and caption dropout, all drawn from its serial alone:
        resumable, and the same whatever the batch size or world size."""
        generator = torch.Generator().manual_seed(self.train.seed * 1_000_003 + serial)
        entry = self.samples[index]
        latents = entry["latents"]  # drawn on the CPU generator so the run is identical on any device
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
        sigma = sample_sigmas(1, self.schedule.sampling, generator, logit_mean=self.train.logit_mean,
                              logit_std=self.train.logit_std, shift=self.train.shift,
                              num_tokens=latents[0].numel() // self.spec.latent_patch ** 2,
                              template=self.schedule.template,
                              sigma_range=self.sigma_range)
        if self.train.caption_dropout > 0 and torch.rand(1, generator=generator).item() < self.train.caption_dropout:
            empty = self.empty_prompt(index) if callable(self.empty_prompt) else self.empty_prompt
            entry = with_empty_prompt(entry, empty)
        return entry, noise, sigma

    # -- EMA and checkpoints -------------------------------------------------------------------
    def _make_ema(self, prepared: Prepared) -> EmaWeights | None:
        if not self.train.ema_decay:
            return None
        on_host = prepared.offload is not None and self.offload_opts.enable_optimizer_cpu_offload
        return EmaWeights(prepared.trainable, self.train.ema_decay, "cpu" if on_host else None)

    def _save(self, prepared: Prepared, sampler: BucketSampler, step: int, ema: EmaWeights | None) -> None:
        if self.rank != 0:
            return
        state = {
            "step": step,
            "epoch": sampler.state.epoch,
            "position": sampler.state.position,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python_rng": random.getstate(),
            "nonfinite_streak": self.nonfinite.streak,
        }
        optimizer_state = {"optimizer": prepared.optimizer.state_dict(), "scheduler": prepared.scheduler.state_dict()}
        if ema is not None:
            optimizer_state["ema"] = ema.state_dict()
        metadata = {**self.checkpoint_metadata, "lora_config": prepared.lora_config, "family": self.spec.name,
                    "step": step, "no_gradient": self.no_gradient}  # None: not known yet (an expert never ran)
        path = self.checkpoints.save(step, dict(prepared.trainable), optimizer_state, state, metadata)
        log.info("checkpoint written: %s", path)

    def _resume(self, prepared: Prepared, sampler: BucketSampler, ema: EmaWeights | None) -> int:
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
        if checkpoint["metadata"].get("no_gradient") is not None:  # else found again at the first step
            self._exclude(prepared, checkpoint["metadata"]["no_gradient"])
        _load_optimizer_keeping_settings(prepared, checkpoint["optimizer"])
        self._resume_ema(ema, prepared, checkpoint)
        state = checkpoint["state"]
        sampler.state = SamplerState(state["epoch"], state["position"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        random.setstate(state["python_rng"])
        self.nonfinite.streak = state.get("nonfinite_streak", 0)
        log.info("resumed from %s (step %d)", checkpoint["path"], state["step"])
        return state["step"]

    @staticmethod
    def _resume_ema(ema: EmaWeights | None, prepared: Prepared, checkpoint: Mapping[str, Any]) -> None:
        if ema is None:
            return
        saved = checkpoint["optimizer"].get("ema")
        if saved is None:  # EMA switched on for a run that trained without it
            log.warning("checkpoint %s holds no EMA: the average starts from the resumed weights", checkpoint["path"])
            ema.load_state_dict({name: p.detach() for name, p in prepared.trainable.items()})
        else:
            ema.load_state_dict(saved)

    # -- reporting -----------------------------------------------------------------------------
    def _report(self, metrics: MetricsLog | None, bar, step: int, sampler: BucketSampler, prepared: Prepared,
                result: StepResult, elapsed: float) -> None:
        if metrics is not None:
            samples = sum(len(batch.indices) for batch in result.batches)
            buckets = " ".join(dict.fromkeys(format_bucket(batch.bucket) for batch in result.batches))
            metrics.log(step=step, epoch=sampler.state.epoch, loss=f"{result.loss:.6g}",
                        lr=f"{prepared.scheduler.get_last_lr()[0]:.6g}", step_time_s=f"{elapsed:.4f}",
                        samples_per_s=f"{samples / elapsed:.3f}", samples=samples, bucket=buckets)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{result.loss:.4f}")

    def _notify(self, hook: str, *args) -> None:
        if self.rank == 0:
            for callback in self.callbacks:
                if hasattr(callback, hook):
                    getattr(callback, hook)(*args)

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


def _load_optimizer_keeping_settings(prepared: Prepared, saved: Mapping[str, Any]) -> None:
    """The optimizer's state (moments, step counts) and the scheduler's position from a checkpoint, with
    this run's settings: ``load_state_dict`` also restores each param group's lr, weight decay and betas
    and the scheduler's base lr, and those of the checkpoint would silently win over a changed config
    (``stages.resume_rule``: they take effect from the resumed step)."""
    optimizer, scheduler = prepared.optimizer, prepared.scheduler
    ours = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    for group, settings in zip(optimizer.param_groups, ours):
        group.update(settings)
    scheduler.base_lrs = [settings["initial_lr"] for settings in ours]
    # the lr the scheduler's last step would have set, as LambdaLR computes it (bitwise the saved lr
    # when nothing changed)
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _all_experts(model: nn.Module, seen: set[str]) -> bool:
    return all(expert.component in seen for expert in model.experts)


def _epochs_completed(sampler: BucketSampler) -> int:
    """Epochs whose every batch has been drawn (the sampler moves to the next epoch lazily)."""
    return sampler.state.epoch + (sampler.state.position >= sampler.batches_per_epoch)


def _all_reduce_mean(params: list[nn.Parameter]) -> None:
    world = dist.get_world_size()
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)
        param.grad /= world
