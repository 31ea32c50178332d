"""A training step must never wait on the cache: a random read of a 1024x1024 Qwen-Image-sized
entry (~0.5 MB latents + ~0.5 MB prompt embeddings) reads about that entry's bytes, not its whole
part, and a store keeps few files.  Read latency itself is a benchmark figure, not a unit test:
`bench/cache.py` prints it (median and p95, warm and cold page cache)."""

from __future__ import annotations

import random

import pytest
import torch

from cache_store import open_cache


def qwen_1024_entry(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    n_tokens = 60 + i % 20
    return {"latents": torch.randn(16, 128, 128, generator=g).to(torch.bfloat16),
            "prompt_embeds": torch.randn(n_tokens, 3584, generator=g).to(torch.bfloat16),
            "prompt_embeds_mask": torch.ones(n_tokens, dtype=torch.int64),
            "meta": {"row": i, "height": 1024, "width": 1024}}


def tensor_bytes(entry: dict) -> int:
    return sum(t.numel() * t.element_size() for k, t in entry.items() if k != "meta")


def bytes_read_so_far() -> int:
    """Bytes this process has passed through read() calls, page cache included (Linux)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_a_random_read_reads_about_its_own_entry(tmp_path, backend):
    n = 40
    store = open_cache(tmp_path / "c", "a", backend=backend)
    for i in range(n):
        store.put(f"k{i:04d}", qwen_1024_entry(i))
        if i % 16 == 15:
            store.commit()  # parts of 16 entries (~16 MB): reading a whole part would show
    store.commit()
    reader = open_cache(tmp_path / "c")
    keys = reader.keys()
    random.Random(0).shuffle(keys)
    reader.get(keys[0])  # first touch opens the part's index
    for key in keys[1:]:
        before = bytes_read_so_far()
        entry = reader.get(key)
        read, size = bytes_read_so_far() - before, tensor_bytes(entry)
        assert entry["meta"]["row"] == int(key[1:]) and entry["latents"].shape == (16, 128, 128)
        # a chunk may straddle two entries and a part's first read opens its index: 3x, not 16x
        assert read <= 3 * size, f"{key}: read {read} bytes for a {size}-byte entry"
    files = reader.stats()["files"]
    assert files <= (12 if backend == "zarr" else n + 8)  # zarr: a few files per part, never per tensor
