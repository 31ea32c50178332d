"""fp8 storage of frozen weights: one power-of-two scale per row.

A weight ``w`` of shape ``(rows, ...)`` is stored as ``q = w / s`` in fp8 with ``s`` a power of two
chosen per row so that the row's largest magnitude lands in the top binade of the format
(``max/2 < |q| <= max``).  Widening back is ``q.to(bf16) * s``: both steps are exact in bf16 and
fp32 (fp8 values are exact there and a power-of-two scale only moves the exponent), so the
device widens to the very same values on any machine and the CPU tests can check them bitwise.
Per-row scales keep rows of small weights (N(0, 0.02) initialisations, LoRA-merged rows) out of
the subnormal range, where a single per-tensor scale loses most of their mantissa bits.
Only tensors with two or more dimensions are stored in fp8; biases and norm scales keep their
dtype (they are a tiny share of the bytes and sensitive to rounding).
"""

from __future__ import annotations

import torch

from . import widen_cuda

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: fp8 codes shaped like ``w`` and float32 per-row power-of-two scales."""
    limit = FP8_MAX[dtype]
    rows = w.detach().float().reshape(w.shape[0], -1)
    amax = rows.abs().amax(dim=1)
    mant, exp = torch.frexp(amax / limit)  # amax/limit = mant * 2**exp, mant in [0.5, 1)
    exp = exp - (mant == 0.5).to(exp.dtype)  # exact powers of two need no extra binade
    scales = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exp), torch.ones_like(amax))
    # The clamp only matters when float rounding of amax/limit picked one binade too few.
    q = (rows / scales[:, None]).clamp_(-limit, limit).to(dtype)
    return q.reshape(w.shape), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scales`` per row, in ``dtype`` (into ``out`` when given); exact, see the module doc.
    On CUDA one Triton kernel does it in a single pass (``widen_cuda``), with the same result."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device) if out is None else out
    if widen_cuda.widen_rows(q, scales, out):
        return out
    out.copy_(q)
    return out.mul_(scales.view(-1, *([1] * (q.dim() - 1))))
