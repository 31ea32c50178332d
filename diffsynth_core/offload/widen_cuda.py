"""The widening of fp8 rows (``quant.dequantize_rows``) as one Triton kernel on CUDA devices.

PyTorch's eager widening is two passes over the widened tensor (cast, then the in-place scale
multiply): 2.39 ms for one real-width Qwen-Image block (340 M weights) on an H200, against
0.27 ms for a single pass that reads the fp8 codes once and writes the result once
(``python -m bench.offload --cases widen``).  With 46 streamed blocks widened twice a step that
was 0.22 s of widening against a 1.0 s step.
Both compute ``fp32(q) * scale`` rounded once to the output dtype, so they agree bit for bit
(``tests/core/offload/test_offload_gpu.py``).  Triton ships with PyTorch's CUDA builds; where it
is missing, the tensor is not on a CUDA device, or the kernel does not compile for the GPU,
``widen_rows`` returns ``False`` and the eager path runs.
"""

from __future__ import annotations

import functools
import warnings

import torch

BLOCK = 2048  # columns per program: 2 KiB of fp8 read, 4 KiB of bf16 written


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def widen_rows(q_ptr, scale_ptr, out_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < cols
        base = row.to(tl.int64) * cols
        scale = tl.load(scale_ptr + row)
        x = tl.load(q_ptr + base + col, mask=mask).to(tl.float32)
        tl.store(out_ptr + base + col, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)

    return widen_rows, triton.cdiv


@functools.cache
def _triton_importable() -> bool:
    try:
        _kernel()
    except Exception:  # no triton in this build (CPU wheels): the eager widening runs
        return False
    return True


# (device capability, fp8 dtype, output dtype) the kernel failed to compile for: Triton's e4m3
# conversion needs compute capability 8.9 or newer, for instance.  Those widen eagerly.
_unsupported: set[tuple] = set()


def widen_rows(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> bool:
    """``out = q * scales`` per row (``q`` of shape ``(rows, ...)``, fp8; ``scales`` fp32) with the
    kernel; ``False`` (nothing written) where it does not apply: not CUDA, not contiguous, no
    Triton, or a GPU it cannot compile for."""
    if not (q.is_cuda and q.is_contiguous() and out.is_contiguous() and q.numel() > 0):
        return False
    key = (torch.cuda.get_device_capability(q.device), q.dtype, out.dtype)
    if key in _unsupported or not _triton_importable():
        return False
    kernel, cdiv = _kernel()
    rows = q.shape[0]
    try:
        kernel[(rows, cdiv(q.numel() // rows, BLOCK))](q, scales, out, q.numel() // rows, BLOCK=BLOCK)
    except Exception as err:  # compilation failed for this GPU: widen eagerly from now on
        _unsupported.add(key)
        warnings.warn(f"offload: the one-pass fp8 widening does not compile here ({type(err).__name__}); "
                      f"using PyTorch's two-pass widening", RuntimeWarning, stacklevel=2)
        return False
    return True
