"""LoRA's down projection saves its input as it came (bf16), not peft's fp32 copy of it.

peft casts an adapted Linear's input to the adapter's dtype before ``lora_A``
(``LoraLayer.forward`` → ``_cast_input_dtype``, peft/tuners/lora/layer.py and
peft/tuners/tuners_utils.py), and autograd saves that fp32 copy for ``lora_A``'s weight gradient:
twice the bytes of the bf16 input, once per adapted Linear (q, k and v each keep their own copy of
one input), alive from a block's recompute to its backward. ``project_down`` casts inside one
autograd Function that saves the input as it came and casts it again in backward. Its backward makes
the products autograd makes for ``F.linear`` (``mm_mat1_backward`` and the column-major branch of
``mm_mat2_backward`` in torch/csrc/autograd/FunctionsManual.cpp, weight.t() being column-major),
the input's gradient in slices of rows so that a wide input's fp32 gradient is never whole on the
device, and the gradients are bitwise those of peft's path (tests/core/training/
test_adapter_inputs.py, on the CPU and the GPU). The Function's Python and the second cast cost
2-5 % of a real-width Qwen-Image step on the H200, so it runs only with ``train.lora_narrow_inputs``
(``prepare.py``; docs/training.md).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


# At most this many bytes of ``x``'s gradient in the weight's dtype (fp32) at a time: a 12288-wide
# MLP input of 4096 tokens would otherwise hold 192 MiB of it beside its 96 MiB bf16 result, at the
# moment a checkpointed block's backward peaks.
GRAD_SLICE_BYTES = 64 << 20
# Slices are whole multiples of this many rows, and only inputs with such a row count are sliced:
# cuBLAS picks its kernel by shape, and on the H200 slices of 256-multiples gave the whole
# product's bits at all 160 sliced shapes of bench/adapter_slices.py at 8b1d56c (and the GPU tests in
# tests/core/training/test_adapter_inputs.py), where 1365 rows of a 12288-wide input did not.
SLICE_ROWS = 256


class _DownProjection(torch.autograd.Function):
    """``F.linear(x.to(weight.dtype), weight)``, saving ``x`` in its own dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.to(weight.dtype), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = None
        # The weight's gradient first, so that its fp32 copy of x is gone before x's gradient exists.
        if ctx.needs_input_grad[1]:
            grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1]).to(weight.dtype))
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(grad_2d, weight, x.dtype).view(x.shape)
        return grad_x, grad_weight


def rows_per_slice(rows: int, weight: torch.Tensor) -> int:
    """How many of ``rows`` rows of ``x``'s gradient ``_input_grad`` makes at a time (whole multiples
    of ``SLICE_ROWS`` within ``GRAD_SLICE_BYTES``), or 0 where it makes the gradient whole: it fits in
    one slice, or the rows do not divide into ``SLICE_ROWS``."""
    per_slice = GRAD_SLICE_BYTES // max(1, weight.shape[1] * weight.element_size()) // SLICE_ROWS * SLICE_ROWS
    return per_slice if per_slice and rows > per_slice and rows % SLICE_ROWS == 0 else 0


def _input_grad(grad_2d: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad_2d.mm(weight).to(dtype)``, in slices of rows of at most ``GRAD_SLICE_BYTES`` before
    their cast where the rows divide into ``SLICE_ROWS``.  Each row of the product is its own sum over
    the adapter's rank; that a slice's kernel sums it as the whole product's does is measured, not
    promised by cuBLAS (``SLICE_ROWS``)."""
    rows = grad_2d.shape[0]
    per_slice = rows_per_slice(rows, weight)
    if not per_slice:
        return grad_2d.mm(weight).to(dtype)
    out = torch.empty(rows, weight.shape[1], dtype=dtype, device=grad_2d.device)
    for start in range(0, rows, per_slice):
        out[start:start + per_slice] = grad_2d[start:start + per_slice].mm(weight)
    return out


def project_down(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` projected by the adapter's ``weight`` in the weight's dtype; saves ``x`` as it came."""
    if x.dtype == weight.dtype:
        return F.linear(x, weight)
    return _DownProjection.apply(x, weight)


class NarrowInputLinear(nn.Linear):
    """peft's bias-free ``lora_A`` Linear, projecting through ``project_down``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project_down(x, self.weight)


def keep_adapter_inputs_narrow(model: nn.Module) -> int:
    """Route every plain peft LoRA Linear's input through ``project_down``; return how many.

    Only layers whose adapters are bias-free, without dropout and without a variant (DoRA) are
    changed: dropout would then run on the bf16 input, a different result. The layer's own cast is
    switched off (``cast_input_dtype_enabled``, peft's switch for it) so ``lora_A`` sees the input
    as it came.
    """
    from peft.tuners.lora.layer import Linear as LoraLinear

    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLinear) or getattr(module, "lora_variant", None):
            continue
        downs = list(module.lora_A.values())
        plain = all(type(d) is nn.Linear and d.bias is None for d in downs) and all(
            isinstance(drop, nn.Identity) for drop in module.lora_dropout.values())
        if not downs or not plain:
            continue
        for down in downs:
            down.__class__ = NarrowInputLinear
        module.cast_input_dtype_enabled = False
        changed += 1
    return changed
