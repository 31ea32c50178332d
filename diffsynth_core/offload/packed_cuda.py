"""The decoding of packed bf16 weights (``packed.unpack``) as one Triton kernel per unit on CUDA.

Eager PyTorch decodes in about ten passes over the weights (int32 temporaries and all); the kernel
reads each weight's byte and half byte once and writes its two bytes once, for every packed tensor
of a unit in one launch, like ``widen_cuda.widen_segments`` does for fp8: 0.74 ms for a real-width
Qwen-Image block (340 M weights, escapes included) on the H200, against 12-15 ms eager
(``python -m bench.offload --cases widen``, ``unit_packed``).  Escapes are written after it by one
``index_copy_`` (``widening``).  Same arithmetic as ``packed.unpack``, so the same bits
(``tests/core/offload/test_packed_gpu.py``); where Triton is missing or does not compile,
``unpack_segments`` returns ``False`` and the eager decoding runs.
"""

from __future__ import annotations

import functools

import torch

from .widen_cuda import launched

BLOCK = 4096  # weights per program: 6 KiB read, 8 KiB written


@functools.cache
def _kernel():
    """``table`` holds six rows of ``MAXSEG`` int64: each segment's first program, its lows',
    nibbles' and output offsets (bytes, bytes, int16 elements), its weights and its base exponent.
    Each program finds its segment by counting the first programs at or below its own id, then
    decodes ``BLOCK`` consecutive weights of it."""
    import triton
    import triton.language as tl

    @triton.jit
    def unpack_segments(src_ptr, out_ptr, table_ptr, n, MAXSEG: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        idx = tl.arange(0, MAXSEG)
        firsts = tl.load(table_ptr + idx, mask=idx < n, other=1 << 62)
        seg = tl.sum((firsts <= pid).to(tl.int32), axis=0) - 1
        local = pid - tl.load(table_ptr + seg)
        numel = tl.load(table_ptr + 4 * MAXSEG + seg)
        base = tl.load(table_ptr + 5 * MAXSEG + seg).to(tl.int32)
        i = local * BLOCK + tl.arange(0, BLOCK)
        mask = i < numel
        low = tl.load(src_ptr + tl.load(table_ptr + MAXSEG + seg) + i, mask=mask).to(tl.int32)
        nib = tl.load(src_ptr + tl.load(table_ptr + 2 * MAXSEG + seg) + i // 2, mask=mask).to(tl.int32)
        code = (nib >> ((i & 1) * 4).to(tl.int32)) & 15
        exp = tl.where(code == 0, 0, code + base - 1)
        bits = ((low & 0x80) << 8) | (exp << 7) | (low & 0x7F)
        bits = bits - ((bits >> 15) << 16)  # 0..65535 into int16's range
        tl.store(out_ptr + tl.load(table_ptr + 3 * MAXSEG + seg) + i, bits.to(tl.int16), mask=mask)

    return unpack_segments


def segment_table(segments: list[tuple[int, int, int, int, int]], device) -> tuple[torch.Tensor, int, int]:
    """The ``table`` of the kernel for ``segments`` = (lows, nibbles, output offsets, weights, base)
    each; returns (table on ``device``, segments, programs)."""
    maxseg = max(2, 1 << (len(segments) - 1).bit_length())
    fields = [[0] * maxseg for _ in range(6)]
    programs = 0
    for i, (low_off, nib_off, out_off, numel, base) in enumerate(segments):
        for f, v in enumerate((programs, low_off, nib_off, out_off, numel, base)):
            fields[f][i] = v
        programs += -(-numel // BLOCK)
    return torch.tensor(fields, dtype=torch.int64, device=device), len(segments), programs


def unpack_segments(src: torch.Tensor, out16: torch.Tensor, table: tuple[torch.Tensor, int, int]) -> bool:
    """Decode every segment of ``table`` from ``src`` (uint8, a unit's stored layout) into ``out16``
    (a flat int16 view of its compute layout) in one launch; ``False`` (nothing written) where the
    kernel does not apply."""
    tensor, n, programs = table
    if not (src.is_cuda and programs > 0):
        return False
    return launched(src, out16, lambda: _kernel()[(programs,)](src, out16, tensor, n, MAXSEG=tensor.shape[1],
                                                                BLOCK=BLOCK), "the packed-weight decoding")
