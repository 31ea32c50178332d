"""The Triton kernels of the offload engine, imported only where Triton is (``widen_cuda.kernels``):
PyTorch's CUDA builds ship it, its CPU builds do not.  Their launchers, and why each exists, live in
``widen_cuda`` (fp8 widening) and ``packed_cuda`` (packed bf16 decoding).

The segment kernels work on several tensors of a unit (*segments*) in one launch; their ``table``
holds one row per field and one column per segment (``widen_cuda.table``), row 0 being each
segment's first program.  The offsets they read from it are unknown to Triton, which then assumes
the worst and moves one byte per instruction; ``Unit.layout`` starts every tensor on 64 bytes, so
the kernels say so (``tl.multiple_of``) and load and store 16 bytes an instruction where their
extent allows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def widen_rows(q_ptr, scale_ptr, out_ptr, cols, BLOCK: tl.constexpr):
    """``out = q * scale`` of one block of one row of a ``(rows, cols)`` tensor."""
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < cols
    base = row.to(tl.int64) * cols
    scale = tl.load(scale_ptr + row)
    x = tl.load(q_ptr + base + col, mask=mask).to(tl.float32)
    tl.store(out_ptr + base + col, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def segment_of(table_ptr, n, MAXSEG: tl.constexpr):
    """The segment this program works on (the number of first programs at or below its id, less
    one) and its index among that segment's programs."""
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, MAXSEG)
    firsts = tl.load(table_ptr + idx, mask=idx < n, other=1 << 62)
    seg = tl.sum((firsts <= pid).to(tl.int32), axis=0) - 1
    return seg, pid - tl.load(table_ptr + seg)


@triton.jit
def widen_segments(q_ptr, scale_ptr, out_ptr, table_ptr, n, MAXSEG: tl.constexpr, BLOCK: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """``widen_rows`` over segments; the table's rows after the first: codes, scales and output
    offsets (elements of their pointers' dtypes), columns per row, programs per row.  ``ALIGNED``:
    every segment's rows are a multiple of 16 columns, so its rows start, and its mask changes, on
    16-element boundaries."""
    seg, local = segment_of(table_ptr, n, MAXSEG)
    cols = tl.load(table_ptr + 4 * MAXSEG + seg)
    if ALIGNED:
        cols = tl.multiple_of(cols, 16)
    per_row = tl.load(table_ptr + 5 * MAXSEG + seg)
    row = local // per_row
    col = (local % per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = col < cols
    scale = tl.load(scale_ptr + tl.load(table_ptr + 2 * MAXSEG + seg) + row)
    q_start = tl.multiple_of(tl.load(table_ptr + MAXSEG + seg), 64)  # fp8 codes: bytes
    out_start = tl.multiple_of(tl.load(table_ptr + 3 * MAXSEG + seg), 16)  # 64 bytes of 2- or 4-byte floats
    x = tl.load(q_ptr + q_start + row * cols + col, mask=mask).to(tl.float32)
    tl.store(out_ptr + out_start + row * cols + col, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _packed_bits(low, code, base):
    """bf16 bits (as int16) from a weight's sign-and-mantissa byte and exponent code (``packed``)."""
    exp = tl.where(code == 0, 0, code + base - 1)
    bits = ((low & 0x80) << 8) | (exp << 7) | (low & 0x7F)
    return (bits - ((bits >> 15) << 16)).to(tl.int16)  # 0..65535 into int16's range


@triton.jit
def unpack_segments(src_ptr, out_ptr, table_ptr, n, MAXSEG: tl.constexpr, BLOCK: tl.constexpr):
    """``packed.unpack`` of ``BLOCK`` weights of a segment; the table's rows after the first: lows',
    nibbles' and output offsets (bytes, bytes, int16 elements), weights, base exponent.  A whole
    block (all of a tensor's but its last) loads unmasked: its nibbles as ``BLOCK // 2`` bytes,
    split and interleaved (weight ``2k`` in the low half of byte ``k``, ``packed.nibble_bytes``);
    the last one, masked, a byte at a time."""
    seg, local = segment_of(table_ptr, n, MAXSEG)
    start = local * BLOCK
    numel = tl.load(table_ptr + 4 * MAXSEG + seg)
    base = tl.load(table_ptr + 5 * MAXSEG + seg).to(tl.int32)
    lows = src_ptr + tl.multiple_of(tl.load(table_ptr + MAXSEG + seg), 64) + start
    nibs = src_ptr + tl.multiple_of(tl.load(table_ptr + 2 * MAXSEG + seg), 64) + start // 2
    outs = out_ptr + tl.multiple_of(tl.load(table_ptr + 3 * MAXSEG + seg), 32) + start
    i = tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        nib = tl.load(nibs + tl.arange(0, BLOCK // 2)).to(tl.int32)
        code = tl.interleave(nib & 15, nib >> 4)
        tl.store(outs + i, _packed_bits(tl.load(lows + i).to(tl.int32), code, base))
    else:
        mask = start + i < numel
        code = (tl.load(nibs + i // 2, mask=mask).to(tl.int32) >> ((i & 1) * 4).to(tl.int32)) & 15
        tl.store(outs + i, _packed_bits(tl.load(lows + i, mask=mask).to(tl.int32), code, base), mask=mask)
