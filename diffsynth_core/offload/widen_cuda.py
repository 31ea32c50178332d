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
from typing import NamedTuple

import torch

BLOCK = 2048  # columns per program: 2 KiB of fp8 read, 4 KiB of bf16 written


@functools.cache
def kernels():
    """``triton_kernels``, or ``None`` where Triton is not importable (CPU wheels): the eager
    widening runs there."""
    try:
        from . import triton_kernels
    except Exception:
        return None
    return triton_kernels


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
        cols = q.numel() // rows
        kernels().widen_rows[(rows, -(-cols // BLOCK))](q, scales, out, cols, BLOCK=BLOCK)
    return launched(q, out, launch)


def launched(q: torch.Tensor, out: torch.Tensor, launch, what: str = "the one-pass fp8 widening") -> bool:
    """Run ``launch`` (a kernel widening ``q`` into ``out``) unless Triton is missing or cannot
    compile for this GPU and these dtypes; whether it ran.  ``what`` names the kernel in the warning."""
    key = (_capability(q.device.index), q.dtype, out.dtype)
    if key in _unsupported or kernels() is None:
        return False
    try:
        launch()
    except Exception as err:  # compilation failed for this GPU: widen eagerly from now on
        _unsupported.add(key)
        warnings.warn(f"offload: {what} does not compile here ({type(err).__name__}); "
                      f"using PyTorch's eager code instead", RuntimeWarning, stacklevel=3)
        return False
    return True


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """The device's compute capability, asked once: ``launched`` runs at every load."""
    return torch.cuda.get_device_capability(index)


class SegmentTable(NamedTuple):
    """What a segment kernel's launch needs: its table on the device, how many segments the table
    holds, how many programs they take, and whether every segment's rows are a multiple of 16."""
    tensor: torch.Tensor
    segments: int
    programs: int
    aligned: bool = False


def table(fields: list[tuple[int, ...]], programs: list[int], device, aligned: bool = False) -> SegmentTable:
    """A segment kernel's table: row 0 each segment's first program (the running sum of
    ``programs``), then a row per field (``fields`` holds one tuple per segment), int64, with
    columns for a power of two of segments (the kernel's ``MAXSEG``)."""
    maxseg = max(2, 1 << (len(fields) - 1).bit_length())
    rows = [[0] * maxseg for _ in range(1 + len(fields[0]))]
    first = 0
    for i, (seg_fields, seg_programs) in enumerate(zip(fields, programs)):
        for f, v in enumerate((first, *seg_fields)):
            rows[f][i] = v
        first += seg_programs
    return SegmentTable(torch.tensor(rows, dtype=torch.int64, device=device), len(fields), first, aligned)


def segment_table(segments: list[tuple[int, int, int, int, int]], device) -> SegmentTable:
    """The table of ``widen_segments`` for ``segments`` = (codes, scales, output offsets in
    elements, rows, columns) each."""
    return table([(q_off, s_off, o_off, cols, -(-cols // BLOCK)) for q_off, s_off, o_off, _, cols in segments],
                 [rows * -(-cols // BLOCK) for *_, rows, cols in segments], device,
                 aligned=all(cols % 16 == 0 for *_, cols in segments))


def widen_segments(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, segments: SegmentTable) -> bool:
    """Widen every segment of ``table`` (``segment_table``) from ``q`` (fp8) and ``scales`` (fp32),
    flat views of one buffer, into ``out``, a flat view of another, in one launch; ``False``
    (nothing written) where the kernel does not apply, as for ``widen_rows``."""
    if not (q.is_cuda and segments.programs > 0):
        return False
    return launched(q, out, lambda: kernels().widen_segments[(segments.programs,)](
        q, scales, out, segments.tensor, segments.segments, MAXSEG=segments.tensor.shape[1], BLOCK=BLOCK,
        ALIGNED=segments.aligned))
