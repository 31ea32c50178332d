"""Input checks shared by the families (clear errors instead of shape mismatches deep in a VAE)."""

from __future__ import annotations

import torch


def check_pixels(pixels: torch.Tensor, *, multiple: int, frame_multiple: int = 1, image_only: bool = False,
                 channels: tuple[int, ...] = (3,)) -> None:
    """Pixels must be ``(C, F, H, W)`` with C in ``channels`` (RGB; RGBA where the VAE takes alpha) and
    H, W multiples of ``multiple``.

    ``image_only``: F must be 1.  Otherwise F must be ``frame_multiple * k + 1`` (Wan: 4k+1).
    """
    if pixels.ndim != 4 or pixels.shape[0] not in channels:
        raise ValueError(f"pixels must be ({' or '.join(map(str, channels))}, F, H, W), got {tuple(pixels.shape)}")
    frames, height, width = pixels.shape[1:]
    if image_only and frames != 1:
        raise ValueError(f"this image family takes one frame, got pixels {tuple(pixels.shape)}")
    if (frames - 1) % frame_multiple:
        raise ValueError(f"frame count must be {frame_multiple}k+1, got {frames}")
    if height % multiple or width % multiple:
        raise ValueError(f"pixel height and width must be multiples of {multiple}, got {height}x{width}")


def prompt_length(tokenizer, requested: int | None, family_default: int) -> int:
    """The requested max prompt length, else the family's default capped at the tokenizer's limit
    (tiny test tokenizers allow far fewer tokens than the released ones)."""
    return requested if requested is not None else min(family_default, tokenizer.model_max_length)


def check_pixel_batch(pixels: torch.Tensor, **rules) -> None:
    """A batch ``(B, C, F, H, W)`` of equally shaped samples, each passing ``check_pixels``."""
    if pixels.ndim != 5 or pixels.shape[0] < 1:
        raise ValueError(f"a pixel batch must be (B, C, F, H, W), got {tuple(pixels.shape)}")
    check_pixels(pixels[0], **rules)


def t5_xxl_prompt_bytes(tokens: int) -> int:
    """Activation bytes of one bf16 prompt padded to ``tokens`` through a T5-XXL-wide encoder
    (T5-XXL, umT5-XXL): eager attention keeps 64 heads of L x L scores in bf16 and fp32 (~10 bytes
    each), ~120 KB per token besides."""
    return 120_000 * tokens + 640 * tokens * tokens


def token_count(tokenizer, text: str) -> int:
    """Tokens ``text`` becomes with the special tokens the pipelines add, before any truncation."""
    return len(tokenizer(text, truncation=False, verbose=False).input_ids)
