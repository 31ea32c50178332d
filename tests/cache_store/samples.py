"""Deterministic synthetic entries: entry ``i`` is the same bytes in every process and run."""

from __future__ import annotations

import torch

from cache_store import fingerprint_of

BUCKETS = [(8, 8), (6, 10), (10, 6), (4, 12)]  # latent (h, w): aspect buckets, so shapes vary


def key_of(i: int) -> str:
    return fingerprint_of({"row": i, "prompt": f"prompt {i}"})


def make_entry(i: int, scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(1000 + i)
    h, w = BUCKETS[i % len(BUCKETS)]
    n_tokens = 5 + i % 17
    return {
        "latents": torch.randn(16, h * scale, w * scale, generator=g).to(torch.bfloat16),
        "prompt_embeds": torch.randn(n_tokens, 64 * scale, generator=g).to(torch.bfloat16),
        "prompt_embeds_mask": torch.ones(n_tokens, dtype=torch.int64),
        "meta": {"row": i, "prompt": f"prompt {i}", "height": h * 8, "width": w * 8},
    }


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_entry(a: dict, b: dict) -> bool:
    """Bitwise equality of every tensor (dtype, shape, bytes) and equal meta."""
    if set(a) != set(b) or a.get("meta") != b.get("meta"):
        return False
    for name, t in a.items():
        if name == "meta":
            continue
        u = b[name]
        if t.dtype != u.dtype or t.shape != u.shape or as_bytes(t) != as_bytes(u):
            return False
    return True
