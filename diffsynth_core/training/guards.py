"""Guards the training loop calls so that a run never writes numbers it cannot trust.

* :class:`NonFiniteGuard` -- a step whose loss or gradient norm is NaN/Inf updates nothing; a
  configurable number of such steps in a row stops the run with one line naming the step.
* :func:`require_finite` -- the last check before weights are checkpointed or exported;
  :func:`require_trained_weights` adds, before the final export, that no weight is absurdly large.
* :class:`GradientCoverage` -- which trainable tensors actually receive a gradient.  Some never do
  (Qwen-Image's last block computes a text-stream output nobody reads, so LoRA on its
  ``to_add_out``/``txt_mlp`` layers is dead weight); they are reported and taken out of the
  optimizer, so no rank applies weight decay to a zero gradient another rank never had.

Every decision is made identically on all data-parallel ranks (one small all-reduce), so ranks
never diverge and exact resume still holds.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InputError

log = logging.getLogger(__name__)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _max_over_ranks(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Element-wise maximum over data-parallel ranks (``values`` itself in one process)."""
    if not _distributed():
        return values
    reduced = values.to(device)  # NCCL reduces device tensors only; gloo runs use the CPU device
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced.cpu()


def grad_norm(params: Sequence[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Total gradient norm, after clipping to ``max_norm`` when given (clip_grad_norm_ computes it anyway)."""
    if max_norm:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


class NonFiniteGuard:
    """Skip updates on NaN/Inf steps; stop after ``limit`` in a row (``train.max_nonfinite_steps``)."""

    def __init__(self, limit: int, learning_rate: float | None = None):
        self.limit, self.learning_rate = limit, learning_rate
        self.streak = 0  # bad steps in a row so far (checkpointed: resume continues the count)

    def allows_update(self, step: int, loss: float, norm: torch.Tensor | None, device: torch.device,
                      gradients: str | None = None) -> bool:
        """True when step ``step`` may update the weights; raises once ``limit`` steps in a row were bad.
        ``norm``: the gradients' total norm, or None where it was never taken (weights stepped during
        backward); ``gradients`` then says what was non-finite among them (None: nothing)."""
        bad = not math.isfinite(loss) or (norm is not None and not bool(torch.isfinite(norm))) or \
            gradients is not None
        bad = bool(_max_over_ranks(torch.tensor([float(bad)]), device)[0])  # one decision for every rank
        if not bad:
            self.streak = 0
            return True
        self.streak += 1
        what = f"loss {loss}" if not math.isfinite(loss) else gradients or f"gradient norm {float(norm)}"
        if self.streak >= self.limit:
            lr = f" (now {self.learning_rate:g})" if self.learning_rate is not None else ""
            raise InputError(
                f"training stopped at step {step}: {what}, {self.streak} step(s) in a row with NaN/Inf "
                f"(train.max_nonfinite_steps = {self.limit}); no non-finite weight was written. Lower "
                f"train.learning_rate{lr}, check the data (splitflow cache verify), or resume from the last "
                f"checkpoint")
        log.warning("step %d: %s: update skipped (%d of at most %d such steps in a row)",
                    step, what, self.streak, self.limit)
        return False


def require_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Refuse to write ``tensors`` (as ``what``) when any holds NaN or Inf; nothing is written then."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise InputError(f"{what}: {len(bad)} of {len(tensors)} tensors hold NaN or Inf (e.g. {bad[:3]}); "
                         f"nothing was written. Lower train.learning_rate and resume from the last checkpoint")


# No trained weight of a diffusion model comes near this: one that does has diverged (a learning
# rate of 1e30 gives LoRA weights of 1e30, finite but meaningless).
ABSURD_WEIGHT = 1e5


def require_trained_weights(tensors: Mapping[str, torch.Tensor], what: str, learning_rate: float | None) -> None:
    """The last check before final weights are exported: finite, and no weight absurdly large."""
    require_finite(tensors, what)
    largest, name = 0.0, None
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.numel():
            peak = float(tensor.detach().abs().max())
            if peak > largest:
                largest, name = peak, key
    if largest > ABSURD_WEIGHT:
        rate = f" (now {learning_rate:g})" if learning_rate is not None else ""
        raise InputError(f"{what}: weight {name} reaches {largest:.3g}, beyond any trained model's "
                         f"({ABSURD_WEIGHT:g}): the run diverged and nothing was written. Lower "
                         f"train.learning_rate{rate} and train into another output.path")


class GradientCoverage:
    """Records which trainable parameters get a gradient during the backward passes it watches."""

    def __init__(self, trainable: Mapping[str, nn.Parameter]):
        self.names = list(trainable)
        self._seen: set[str] = set()
        self._handles = [p.register_post_accumulate_grad_hook(lambda _p, n=name: self._seen.add(n))
                         for name, p in trainable.items()]

    def finish(self, device: torch.device) -> list[str]:
        """Stop watching; the names no rank gave a gradient to, reported in one warning line."""
        for handle in self._handles:
            handle.remove()
        seen = torch.tensor([float(name in self._seen) for name in self.names])
        seen = _max_over_ranks(seen, device)
        unused = [name for name, flag in zip(self.names, seen.tolist()) if not flag]
        if unused:
            log.warning("%d trainable tensor(s) get no gradient and are left out of the optimizer (the model "
                        "never uses their output; drop them from train.lora_target_modules): %s",
                        len(unused), ", ".join(_modules_of(unused)))
        return unused


def _modules_of(names: Sequence[str]) -> list[str]:
    """``blocks.1.attn.to_add_out.lora_A.default.weight`` -> ``blocks.1.attn.to_add_out`` (once each)."""
    modules = [name.split(".lora_")[0] if ".lora_" in name else name for name in names]
    return list(dict.fromkeys(modules))


def exclude_from_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
    """Take ``params`` out of every param group (before they have optimizer state)."""
    drop = {id(p) for p in params}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in drop]
