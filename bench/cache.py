"""Cache throughput: write and random-read 1,000 entries of a 1024x1024 Qwen-Image sample.

Each entry: latents bf16 (16, 128, 128) = 0.5 MB, prompt embeddings bf16 (L, 3584) with L in
[40, 110) = 0.3-0.8 MB, and the int64 mask.  Prints one JSON object per backend:
write MB/s and ms/entry (incl. commits every 256 entries), random-order read MB/s and ms/entry
(median, p95) warm and cold (page cache dropped per file with posix_fadvise), files, bytes.

    .venv/bin/python bench/cache.py [--n 1000] [--dir /tmp/splitflow-bench] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import torch

from cache_store import open_cache

VARIANTS = {"zarr": {"backend": "zarr"}, "zarr-uncompressed": {"backend": "zarr", "compression": None},
            "pth": {"backend": "pth"}}


def make_pool(size: int = 64) -> list[dict]:
    """Distinct realistic entries, built before timing so the RNG is not measured."""
    g = torch.Generator().manual_seed(0)
    pool = []
    for i in range(size):
        n_tokens = 40 + (i * 37) % 70
        pool.append({"latents": torch.randn(16, 128, 128, generator=g).to(torch.bfloat16),
                     "prompt_embeds": torch.randn(n_tokens, 3584, generator=g).to(torch.bfloat16),
                     "prompt_embeds_mask": torch.ones(n_tokens, dtype=torch.int64),
                     "meta": {"height": 1024, "width": 1024, "prompt": f"caption {i}"}})
    return pool


def nbytes(entry: dict) -> int:
    return sum(t.numel() * t.element_size() for k, t in entry.items() if k != "meta")


def drop_page_cache(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def write(url: Path, n: int, pool: list[dict], opts: dict) -> tuple[float, int]:
    store = open_cache(url, "a", fingerprint="bench", **opts)
    total, t0 = 0, time.perf_counter()
    for i in range(n):
        entry = pool[i % len(pool)]
        store.put(f"e{i:06d}", entry)
        total += nbytes(entry)
        if i % 256 == 255:
            store.commit()
    store.commit()
    return time.perf_counter() - t0, total


def read(url: Path, cold: bool) -> list[float]:
    if cold:
        drop_page_cache(url)
    store = open_cache(url)
    keys = store.keys()
    random.Random(1).shuffle(keys)
    times = []
    for key in keys:
        t = time.perf_counter()
        store.get(key)
        times.append(time.perf_counter() - t)
    return times


def bench(name: str, root: Path, n: int, pool: list[dict]) -> dict:
    url = root / name
    shutil.rmtree(url, ignore_errors=True)
    seconds, total = write(url, n, pool, VARIANTS[name])
    stats = open_cache(url).stats()
    out = {"backend": name, "entries": n, "entry_mb": round(total / n / 1e6, 3),
           "write_mb_s": round(total / seconds / 1e6, 1), "write_ms_per_entry": round(seconds / n * 1e3, 2),
           "files": stats["files"], "disk_mb": round(stats["bytes"] / 1e6, 1)}
    for label, cold in (("cold", True), ("warm", False)):
        times = read(url, cold)
        out[f"read_{label}_mb_s"] = round(total / sum(times) / 1e6, 1)
        out[f"read_{label}_ms_median"] = round(statistics.median(times) * 1e3, 2)
        out[f"read_{label}_ms_p95"] = round(sorted(times)[int(0.95 * len(times))] * 1e3, 2)
    shutil.rmtree(url, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--dir", default="/tmp/splitflow-bench")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = one core)")
    ap.add_argument("--backends", default=",".join(VARIANTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pool = make_pool()
    for name in args.backends.split(","):
        print(json.dumps(bench(name, Path(args.dir), args.n, pool)), flush=True)


if __name__ == "__main__":
    main()
