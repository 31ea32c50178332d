"""A training step must never wait on the cache: reading a 1024x1024 Qwen-Image-sized entry
(~0.5 MB latents + ~0.5 MB prompt embeddings) costs <= 10 ms on one core; few files."""

from __future__ import annotations

import random
import statistics
import time

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


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_random_read_of_a_1mb_entry_is_fast(tmp_path, backend):
    n = 40
    store = open_cache(tmp_path / "c", "a", backend=backend)
    for i in range(n):
        store.put(f"k{i:04d}", qwen_1024_entry(i))
        if i % 16 == 15:
            store.commit()
    store.commit()
    reader = open_cache(tmp_path / "c")
    keys = reader.keys()
    random.Random(0).shuffle(keys)
    reader.get(keys[0])  # first touch opens the part
    times, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as a DataLoader worker has
    try:
        for key in keys:
            t = time.perf_counter()
            entry = reader.get(key)
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    assert entry["latents"].shape == (16, 128, 128)
    assert statistics.median(times) <= 0.010, f"median read {statistics.median(times) * 1e3:.1f} ms"
    files = reader.stats()["files"]
    assert files <= (12 if backend == "zarr" else n + 8)  # zarr: a few files per part, never per tensor
