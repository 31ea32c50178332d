"""An exponential moving average (EMA) of the trainable weights.

After every optimizer step ``ema = decay * ema + (1 - decay) * weight``, in float32, starting from the
weights training starts with.  The average lives on the device its weights do, or on the host when
asked (under optimizer offload the weights step on the host, so the average costs no GPU memory).
It is saved with every checkpoint and exported beside the raw weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
from torch import nn


class EmaWeights:
    def __init__(self, params: Mapping[str, torch.Tensor], decay: float, device: torch.device | str | None = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.average = {name: p.detach().to(device or p.device, torch.float32, copy=True)
                        for name, p in params.items()}

    @torch.no_grad()
    def update(self, params: Mapping[str, torch.Tensor]) -> None:
        names = list(self.average)
        current = [params[n].detach().to(self.average[n].device, torch.float32) for n in names]
        torch._foreach_lerp_([self.average[n] for n in names], current, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().cpu().clone() for name, t in self.average.items()}

    def load_state_dict(self, saved: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self.average) - set(saved))
        if missing:
            raise KeyError(f"saved EMA lacks {missing[:5]} ({len(missing)} in all)")
        for name, t in self.average.items():
            t.copy_(saved[name])


@contextlib.contextmanager
def swapped_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> Iterator[nn.Module]:
    """Run the body with ``weights`` (by parameter name) in place of the model's own, restored after."""
    params = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise KeyError(f"weights name no parameter of the model: {unknown[:5]}")
    kept = {name: params[name].data for name in weights}
    try:
        for name, value in weights.items():
            params[name].data = value.to(kept[name].device, kept[name].dtype)
        yield model
    finally:
        for name, data in kept.items():
            params[name].data = data
