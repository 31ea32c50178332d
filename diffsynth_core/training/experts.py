"""Several trainable transformers in one run (``FamilySpec.experts``: Wan2.2 A14B's high- and low-noise DiTs).

Each sample's sigma is drawn as for one transformer (from its draw serial alone) and routed to the
expert whose ``[sigma_min, sigma_max]`` holds it (the first in routing order at a shared boundary,
as diffusers gives ``t >= boundary`` to ``transformer``).  A batch whose samples fall on both sides
is **split**: each part runs through its own expert and the predictions are put back in batch order,
so the loss is the very mean a single transformer would take.  Splitting rather than drawing one
sigma per batch keeps every sample's draw independent of the batch size and the world size (the
loop's rule), at the price of two smaller forwards in a mixed batch; with video (batch 1) each step
is one expert.  An expert that gets no sample in a step gets no gradient, so the optimizer leaves
its LoRA (and its moments) untouched.

:class:`ExpertModels` holds the experts as submodules named by their component, so parameter
names (checkpoints, the offload engine's units, LoRA targets) say which expert they belong to:
``transformer.blocks.0.attn1.to_q.lora_A.default.weight``, ``transformer_2.blocks.0...``.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import InputError
from ..models.base import Expert, FamilySpec

SIGMA_RANGE = (0.0, 1.0)


class ExpertModels(nn.Module):
    """The experts a run trains, in routing order, each a submodule named by its component."""

    def __init__(self, experts: Sequence[Expert], models: Mapping[str, nn.Module]):
        super().__init__()
        self.experts = tuple(experts)
        for expert in self.experts:
            self.add_module(expert.component, models[expert.component])
        self.ran: set[str] = set()  # components that got samples since the last take_ran()

    @property
    def dtype(self) -> torch.dtype:  # the inputs' dtype, as diffusers' ModelMixin.dtype gives it
        return getattr(self.expert_model(self.experts[0]), "dtype", torch.float32)

    def expert_model(self, expert: Expert) -> nn.Module:
        return getattr(self, expert.component)

    def block_containers(self, names: Sequence[str]) -> tuple[str, ...]:
        """The family's block containers inside every expert (``transformer.blocks``, ...)."""
        return tuple(f"{expert.component}.{name}" for expert in self.experts for name in names)

    def route(self, sigmas: torch.Tensor) -> list[tuple[Expert, torch.Tensor]]:
        """``(expert, batch indices)`` for every expert that serves some of ``sigmas``."""
        owner = torch.full(sigmas.shape, -1, dtype=torch.long)
        values = sigmas.detach().float().cpu()
        for i, expert in reversed(list(enumerate(self.experts))):  # the first listed wins at a boundary
            owner[(values >= expert.sigma_min) & (values <= expert.sigma_max)] = i
        if bool((owner < 0).any()):
            raise ValueError(f"sigmas {values[owner < 0].tolist()} lie outside every expert's range "
                             f"{[(e.sigma_min, e.sigma_max) for e in self.experts]}")
        return [(e, (owner == i).nonzero().flatten()) for i, e in enumerate(self.experts) if bool((owner == i).any())]

    def take_ran(self) -> set[str]:
        ran, self.ran = self.ran, set()
        return ran


def block_containers(model: nn.Module, spec: FamilySpec) -> tuple[str, ...]:
    """Where the blocks of ``model`` are: the family's containers, inside each expert for several."""
    if isinstance(model, ExpertModels):
        return model.block_containers(spec.block_container_names)
    return spec.block_container_names


def predict(dit_forward: Callable, model: nn.Module, latents: torch.Tensor, sigmas: torch.Tensor,
            cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``dit_forward`` over one transformer, or over each expert's share of the batch, in batch order."""
    if not isinstance(model, ExpertModels):
        return dit_forward(model, latents, sigmas, cond)
    parts = model.route(sigmas)
    if len(parts) == 1:  # the whole batch on one expert: no gather
        model.ran.add(parts[0][0].component)
        return dit_forward(model.expert_model(parts[0][0]), latents, sigmas, cond)
    outputs, order = [], []
    for expert, index in parts:
        model.ran.add(expert.component)
        on_device = index.to(latents.device)
        part_cond = {k: v.index_select(0, on_device) for k, v in cond.items()}
        outputs.append(dit_forward(model.expert_model(expert), latents.index_select(0, on_device),
                                   sigmas.index_select(0, index.to(sigmas.device)), part_cond))
        order.append(index)
    inverse = torch.argsort(torch.cat(order)).to(latents.device)
    return torch.cat(outputs).index_select(0, inverse)


def trained_sigma_range(experts: Sequence[Expert], sigma_range: Sequence[float] | None) -> tuple[float, float]:
    """The sigmas a run draws: ``train.sigma_range`` within what the trained experts serve together."""
    low, high = tuple(sigma_range) if sigma_range else SIGMA_RANGE
    if experts:
        low = max(low, min(e.sigma_min for e in experts))
        high = min(high, max(e.sigma_max for e in experts))
    if not low < high:
        served = ", ".join(f"{e.component} [{e.sigma_min:g}, {e.sigma_max:g}]" for e in experts)
        raise InputError(f"train.sigma_range {list(sigma_range or SIGMA_RANGE)} leaves no sigma for the experts "
                         f"trained ({served}): widen it or train another expert (train.experts)")
    return low, high


def select_experts(spec: FamilySpec, names: Sequence[str] | None,
                   sigma_range: Sequence[float] | None) -> tuple[Expert, ...]:
    """The experts a run trains: ``train.experts`` by component, else those ``train.sigma_range`` reaches
    (DiffSynth's one-expert scripts give only the range); none for a one-transformer family."""
    if not spec.experts:
        if names:
            raise InputError(f"train.experts {list(names)}: family {spec.name} ({spec.variant or 'base'}) "
                             "has one transformer; leave train.experts unset")
        return ()
    by_name = {e.component: e for e in spec.experts}
    if names:
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise InputError(f"train.experts {unknown} name no expert of {spec.name} {spec.variant}; "
                             f"its experts: {', '.join(by_name)}")
        return tuple(e for e in spec.experts if e.component in names)
    low, high = tuple(sigma_range) if sigma_range else SIGMA_RANGE
    reached = tuple(e for e in spec.experts if e.sigma_min < high and e.sigma_max > low)
    return reached or spec.experts


def experts_that_ran(model: nn.Module, device: torch.device) -> set[str] | None:
    """The experts that got samples in this step on any rank (None: ``model`` is one transformer).
    One decision for every rank, so data-parallel ranks step the same experts."""
    if not isinstance(model, ExpertModels):
        return None
    from .guards import _max_over_ranks

    ran = model.take_ran()
    flags = _max_over_ranks(torch.tensor([float(e.component in ran) for e in model.experts]), device)
    return {e.component for e, flag in zip(model.experts, flags.tolist()) if flag}


def drop_idle_gradients(model: ExpertModels, ran: set[str]) -> None:
    """No gradient on the experts that no rank ran (the data-parallel average gives them zeros):
    the optimizer then skips their weights, moments and weight decay alike."""
    for expert in model.experts:
        if expert.component not in ran:
            for param in model.expert_model(expert).parameters():
                param.grad = None
