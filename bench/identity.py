"""Cost of identifying a model by content: first hash of its weights vs a hit in the digest memo.

Builds a Qwen-Image-layout folder whose encoder components hold ``--gb`` GB of random weights
(split into ``--files`` files), then times ``stages.common.encoder_identity`` (what preprocess,
train and status compute) side by side:

* ``cold``: first run on a machine, page cache dropped per file (posix_fadvise DONTNEED);
* ``warm``: first run, files already in the page cache (sha256 speed bound);
* ``memo_hit``: a later run (new process state, memo read from SQLite): one stat per file;
* ``name_size``: the identity splitflow used before (names and sizes only), for scale.

    .venv/bin/python -m bench.identity [--gb 2] [--files 4] [--dir /tmp/splitflow-bench-identity]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from cache_store import digests
from diffsynth_core.models import get_family
from stages.common import component_files, encoder_identity
from stages.config import build_config


def make_model(root: Path, total_bytes: int, files: int, components: tuple[str, ...]) -> None:
    per_file = total_bytes // (files * len(components))
    chunk = os.urandom(1 << 24)
    old = time.time() - 3600  # weights written long ago (a fresh file is not remembered: racy)
    for name in components:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text("{}")
        for i in range(files):
            path = folder / f"model-{i:05d}.safetensors"
            with open(path, "wb") as handle:
                for _ in range(per_file // len(chunk)):
                    handle.write(chunk)
            os.utime(path, (old, old))
        os.utime(folder / "config.json", (old, old))


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--files", type=int, default=4, help="weight files per encoder component")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="splitflow-bench-identity-"))
    os.environ["SPLITFLOW_CACHE_DIR"] = str(work / "memo")
    spec = get_family("qwen_image")
    make_model(work / "model", int(args.gb * (1 << 30)), args.files, spec.encoder_components)
    cfg = build_config({"model": {"family": "qwen_image", "path": str(work / "model")}})
    paths = [p for name in spec.encoder_components for p in component_files(cfg, spec, name)]
    nbytes = sum(p.stat().st_size for p in paths)

    def fresh_memo(drop: bool = False):
        shutil.rmtree(work / "memo", ignore_errors=True)
        digests._memo = None
        if drop:
            drop_page_cache(paths)
        return encoder_identity(cfg, spec)

    cold, identity = timed(lambda: fresh_memo(drop=True))
    warm, again = timed(fresh_memo)
    digests._memo = None  # a new run: nothing in this process, the SQLite memo answers
    hit, remembered = timed(lambda: encoder_identity(cfg, spec))
    assert identity == again == remembered and digests.memo().hashed == 0
    name_size, _ = timed(lambda: {str(p): p.stat().st_size for p in paths})
    print(json.dumps({
        "bench": "identity", "files": len(paths), "bytes": nbytes,
        "cold_s": round(cold, 3), "cold_GBps": round(nbytes / cold / 1e9, 2),
        "warm_s": round(warm, 3), "warm_GBps": round(nbytes / warm / 1e9, 2),
        "memo_hit_s": round(hit, 5), "name_size_s": round(name_size, 5),
        "first_over_hit": round(warm / hit, 1),
    }))
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
