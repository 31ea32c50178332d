"""Cost of identifying a model by content: first hash of its weights vs a hit in the digest memo.

Builds a Qwen-Image-layout folder whose encoder components hold ``--gb`` GB of random weights
(split into ``--files`` files), then times ``stages.common.encoder_identity`` (what preprocess,
train and status compute) side by side:

* ``cold``: first run on a machine, page cache dropped per file (posix_fadvise DONTNEED);
* ``warm``: first run, files already in the page cache (sha256 speed bound);
* ``memo_hit``: a later run (new process state, memo read from SQLite): one stat per file;
* ``name_size``: the identity splitflow used before (names and sizes only), for scale;
* ``plan_*``: keying a dataset of ``--rows`` images from the config (what ``train`` and
  ``status`` now do before anything else), first time vs memo hit.

    .venv/bin/python -m bench.identity [--gb 2] [--files 4] [--rows 2000] [--dir /tmp/splitflow-bench-identity]
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
from stages.keys import make_plan


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


def make_dataset(folder: Path, rows: int) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    old = time.time() - 3600
    lines = ["image,prompt"]
    for i in range(rows):
        path = folder / f"{i:06d}.png"
        Image.new("RGB", (64, 48), (i % 256, (i // 256) % 256, 7)).save(path)
        os.utime(path, (old, old))
        lines.append(f"{path.name},sample {i}")
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    return folder / "metadata.csv"


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
    parser.add_argument("--rows", type=int, default=2000, help="dataset images for the plan timing")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="splitflow-bench-identity-"))
    os.environ["SPLITFLOW_CACHE_DIR"] = str(work / "memo")
    spec = get_family("qwen_image")
    make_model(work / "model", int(args.gb * (1 << 30)), args.files, spec.encoder_components)
    metadata = make_dataset(work / "dataset", args.rows)
    cfg = build_config({"model": {"family": "qwen_image", "path": str(work / "model")},
                        "dataset": {"base_path": str(work / "dataset"), "metadata_path": str(metadata)}})
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
    digests._memo = None
    plan_first, first_plan = timed(lambda: make_plan(cfg))  # encoders remembered, images not yet
    digests._memo = None
    plan_hit, plan = timed(lambda: make_plan(cfg))
    assert plan.keys == first_plan.keys
    print(json.dumps({
        "bench": "identity", "files": len(paths), "bytes": nbytes,
        "cold_s": round(cold, 3), "cold_GBps": round(nbytes / cold / 1e9, 2),
        "warm_s": round(warm, 3), "warm_GBps": round(nbytes / warm / 1e9, 2),
        "memo_hit_s": round(hit, 5), "name_size_s": round(name_size, 5),
        "first_over_hit": round(warm / hit, 1),
        "rows": args.rows, "plan_first_s": round(plan_first, 3), "plan_memo_hit_s": round(plan_hit, 3),
    }))
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
