"""Lossless 12-bit storage of bf16 weights (``storage_dtype="packed_bfloat16"``).

A bf16 weight is sign (1 bit), exponent (8) and mantissa (7).  The sign and mantissa are close to
uniformly random and are kept as they are, one byte per weight (*lows*: ``sign << 7 | mantissa``).
The exponents of a trained or initialised weight crowd into a few binades below its largest
magnitude, so each is kept as a 4-bit *code*, two per byte (*nibbles*; element ``i`` in the low
nibble of byte ``i // 2`` when ``i`` is even, in the high one when odd):

* code 0: exponent 0 (zeros and subnormals; their mantissa is in the low byte, so exact);
* codes 1..14: exponent ``base + code - 1``, fourteen binades chosen per tensor to cover the most
  weights (``choose_base``);
* code 15: an *escape*: any other exponent (a weight 2^-13 below the window's top, an inf or a
  NaN); its position and its 16 bits are kept aside and written over the decoded value.

That is 1.5 bytes a weight plus 10 bytes an escape, against 2: the bytes each load copies over
PCIe, and the host RAM, drop to ~75 %, and the device decodes the very same bits (the tests check
them bitwise against the original), so training is bitwise what bf16 storage trains.  A tensor
with more than ``MAX_ESCAPE_SHARE`` escapes (exponents spread over many binades) is kept in bf16.
Only frozen bf16 weights of two or more dimensions are packed, as for fp8 (biases and norm scales
are a tiny share of the bytes).  On CUDA one Triton kernel decodes a unit (``packed_cuda``); this
module is the reference it must equal, and the path on a CPU target.
"""

from __future__ import annotations

import torch

PACKED = "packed_bfloat16"  # the storage_dtype value that asks for this format
WINDOW = 14  # exponents codes 1..14 stand for
ESCAPE = 15
MAX_ESCAPE_SHARE = 1 / 64  # beyond it, keeping the tensor in bf16 costs fewer bytes than escapes


def packable(p: torch.Tensor) -> bool:
    return p.dtype == torch.bfloat16 and p.dim() >= 2 and p.numel() > 0


def _fields(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 16 bits of each weight as int32 in 0..65535, its exponent), flat."""
    bits = w.detach().reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
    return bits, (bits >> 7) & 0xFF


def choose_base(w: torch.Tensor) -> tuple[int, int]:
    """``(base, escapes)``: the first of the ``WINDOW`` consecutive non-zero exponents that hold the
    most weights of ``w`` (bf16), and how many weights fall outside them and exponent 0."""
    _, exp = _fields(w)
    counts = torch.bincount(exp, minlength=256).cpu()
    counts[0] = 0  # exponent 0 has its own code
    window_sums = counts.unfold(0, WINDOW, 1).sum(dim=1)  # window_sums[b] = weights in b..b+13
    window_sums[0] = -1  # base 0 would give code 1 to exponent 0 as well
    base = int(torch.argmax(window_sums))
    return base, int(counts.sum() - window_sums[base])


def nibble_bytes(numel: int) -> int:
    """Bytes of the codes of ``numel`` weights, two a byte."""
    return (numel + 1) // 2


def pack(w: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lows, nibbles, escape positions, escape bits)`` of ``w`` (bf16): lows uint8 shaped like
    ``w``, nibbles uint8 of ``nibble_bytes(n)``, positions int64 (flat), bits int16, all on ``w``'s
    device."""
    bits, exp = _fields(w)
    lows = ((bits >> 8) & 0x80) | (bits & 0x7F)
    inside = (exp >= base) & (exp < base + WINDOW)
    codes = torch.where(exp == 0, 0, torch.where(inside, exp - base + 1, ESCAPE))
    escapes = torch.nonzero(codes == ESCAPE).reshape(-1)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    nibbles = codes[0::2] | (codes[1::2] << 4)
    escaped = bits[escapes]
    signed = escaped - ((escaped >> 15) << 16)  # 0..65535 back to int16's range
    return (lows.to(torch.uint8).reshape(w.shape), nibbles.to(torch.uint8), escapes,
            signed.to(torch.int16))


def unpack(lows: torch.Tensor, nibbles: torch.Tensor, base: int, out: torch.Tensor) -> torch.Tensor:
    """Decode ``lows`` and ``nibbles`` into ``out`` (bf16, shaped like ``lows``); escapes are left
    for ``patch``.  The same arithmetic as the kernel in ``packed_cuda``."""
    n = lows.numel()
    nib = nibbles.to(torch.int32)
    codes = torch.stack([nib & 0xF, nib >> 4], dim=1).reshape(-1)[:n]
    exp = torch.where(codes == 0, 0, codes + (base - 1))
    low = lows.reshape(-1).to(torch.int32)
    bits = ((low & 0x80) << 8) | (exp << 7) | (low & 0x7F)
    bits = bits - ((bits >> 15) << 16)
    out.view(torch.int16).reshape(-1).copy_(bits)
    return out


def patch(flat16: torch.Tensor, positions: torch.Tensor, bits: torch.Tensor) -> None:
    """Write the escaped weights' ``bits`` (int16) at ``positions`` of ``flat16`` (a flat int16 view)."""
    if positions.numel():
        flat16.index_copy_(0, positions, bits)


def decode(lows: torch.Tensor, nibbles: torch.Tensor, base: int, positions: torch.Tensor,
           bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 tensor from its packed form (positions relative to the tensor), into ``out`` (bf16,
    contiguous, shaped like ``lows``) or a new tensor."""
    if out is None:
        out = torch.empty(lows.shape, dtype=torch.bfloat16, device=lows.device)
    unpack(lows, nibbles, base, out)
    patch(out.view(torch.int16).reshape(-1), positions, bits)
    return out
