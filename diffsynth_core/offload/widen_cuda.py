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
def _segments_kernel():
    """``widen_rows`` over several tensors in one launch: a unit's fp8 weights (*segments*), read
    from one buffer and written into another.  ``table`` holds six rows of ``MAXSEG`` int64: each
    segment's first program, and its codes, scales and output offsets (in elements of their
    pointers' dtypes), columns per row and programs per row.  Each program finds its segment by
    counting the first programs at or below its own id, then widens one block of one row."""
    import triton
    import triton.language as tl

    @triton.jit
    def widen_segments(q_ptr, scale_ptr, out_ptr, table_ptr, n, MAXSEG: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, MAXSEG)
        firsts = tl.load(table_ptr + idx, mask=idx < n, other=1 << 62)
        seg = tl.sum((firsts <= pid).to(tl.int32), axis=0) - 1
        local = pid - tl.load(table_ptr + seg)
        cols = tl.load(table_ptr + 4 * MAXSEG + seg)
        per_row = tl.load(table_ptr + 5 * MAXSEG + seg)
        row = local // per_row
        col = (local % per_row) * BLOCK + tl.arange(0, BLOCK)
        mask = col < cols
        scale = tl.load(scale_ptr + tl.load(table_ptr + 2 * MAXSEG + seg) + row)
        x = tl.load(q_ptr + tl.load(table_ptr + MAXSEG + seg) + row * cols + col, mask=mask).to(tl.float32)
        out = out_ptr + tl.load(table_ptr + 3 * MAXSEG + seg) + row * cols + col
        tl.store(out, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)

    return widen_segments


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
    rows = q.shape[0]

    def launch():
        kernel, cdiv = _kernel()
        kernel[(rows, cdiv(q.numel() // rows, BLOCK))](q, scales, out, q.numel() // rows, BLOCK=BLOCK)
    return launched(q, out, launch)


def launched(q: torch.Tensor, out: torch.Tensor, launch, what: str = "the one-pass fp8 widening") -> bool:
    """Run ``launch`` (a kernel widening ``q`` into ``out``) unless Triton is missing or cannot
    compile for this GPU and these dtypes; whether it ran.  ``what`` names the kernel in the warning."""
    key = (torch.cuda.get_device_capability(q.device), q.dtype, out.dtype)
    if key in _unsupported or not _triton_importable():
        return False
    try:
        launch()
    except Exception as err:  # compilation failed for this GPU: widen eagerly from now on
        _unsupported.add(key)
        warnings.warn(f"offload: {what} does not compile here ({type(err).__name__}); "
                      f"using PyTorch's eager code instead", RuntimeWarning, stacklevel=3)
        return False
    return True


def segment_table(segments: list[tuple[int, int, int, int, int]], device) -> tuple[torch.Tensor, int, int]:
    """The ``table`` of ``widen_segments`` for ``segments`` = (codes, scales, output offsets in
    elements, rows, columns) each; returns (table on ``device``, segments, programs)."""
    maxseg = max(2, 1 << (len(segments) - 1).bit_length())
    fields = [[0] * maxseg for _ in range(6)]
    programs = 0
    for i, (q_off, s_off, o_off, rows, cols) in enumerate(segments):
        per_row = -(-cols // BLOCK)
        for f, v in enumerate((programs, q_off, s_off, o_off, cols, per_row)):
            fields[f][i] = v
        programs += rows * per_row
    return torch.tensor(fields, dtype=torch.int64, device=device), len(segments), programs


def widen_segments(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, table: tuple[torch.Tensor, int, int]) -> bool:
    """Widen every segment of ``table`` (``segment_table``) from ``q`` (fp8) and ``scales`` (fp32),
    flat views of one buffer, into ``out``, a flat view of another, in one launch; ``False``
    (nothing written) where the kernel does not apply, as for ``widen_rows``."""
    tensor, n, programs = table
    if not (q.is_cuda and programs > 0):
        return False
    return launched(q, out, lambda: _segments_kernel()[(programs,)](q, scales, out, tensor, n,
                                                                      MAXSEG=tensor.shape[1], BLOCK=BLOCK))
