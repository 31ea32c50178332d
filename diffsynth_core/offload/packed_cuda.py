"""The decoding of packed bf16 weights (``packed.unpack``) as one Triton kernel per unit on CUDA.

Eager PyTorch decodes in about ten passes over the weights (int32 temporaries and all); the kernel
reads each weight's byte and half byte once and writes its two bytes once, for every packed tensor
of a unit in one launch, like ``widen_cuda.widen_segments`` does for fp8: 0.47 ms for a real-width
Qwen-Image block (340 M weights, escapes included) on the H200, against 12-15 ms eager
(``python -m bench.offload --cases widen``, ``unit_packed``).  Escapes are written after it by one
``index_copy_`` (``widening``).  Same arithmetic as ``packed.unpack``, so the same bits
(``tests/core/offload/test_packed_gpu.py``); where Triton is missing or does not compile,
``unpack_segments`` returns ``False`` and the eager decoding runs.
"""

from __future__ import annotations

import torch

from .widen_cuda import SegmentTable, kernels, launched, table

BLOCK = 4096  # weights per program: 6 KiB read, 8 KiB written


def segment_table(segments: list[tuple[int, int, int, int, int]], device) -> SegmentTable:
    """The table of the kernel for ``segments`` = (lows, nibbles, output offsets, weights, base)
    each."""
    return table(segments, [-(-numel // BLOCK) for *_, numel, _ in segments], device)


def unpack_segments(src: torch.Tensor, out16: torch.Tensor, segments: SegmentTable) -> bool:
    """Decode every segment of ``table`` from ``src`` (uint8, a unit's stored layout) into ``out16``
    (a flat int16 view of its compute layout) in one launch; ``False`` (nothing written) where the
    kernel does not apply."""
    if not (src.is_cuda and segments.programs > 0):
        return False
    return launched(src, out16, lambda: kernels().unpack_segments[(segments.programs,)](
        src, out16, segments.tensor, segments.segments, MAXSEG=segments.tensor.shape[1], BLOCK=BLOCK),
        "the packed-weight decoding")
