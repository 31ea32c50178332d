"""Preprocessing by N worker processes writing one shared cache, simulated on this machine's CPUs.

    python -m bench.scaling                          # N = 1, 2, 4 workers, a shared folder cache
    python -m bench.scaling --s3                     # the same cache on s3:// (moto's server)
    python -m bench.scaling --workers 1,2 --images 48 --side 192

For each N the dataset is split into N parts (``preprocess.parts = N``) and N processes run
``python -m flows.cli preprocess CONFIG --part K`` at once, each one part, into one fresh cache
(what N machines of a pool do).  Prints one JSON document: per N, the wall time from the first
start to the last exit, each worker's encoded and reused counts, and whether every entry was
encoded exactly once (the sum of the workers' ``encoded`` equals the cache's entries, and a
finalize finds the cache complete), plus the workers' CPU seconds and the machine's load average
(on a shared machine the wall time says more about the neighbours than about the code).
Start-up (Python, torch, the tiny model) is paid by every worker, as on real machines.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.preprocess import emit, write_dataset  # noqa: E402
from cache_store import open_cache  # noqa: E402
from stages import preprocess  # noqa: E402
from stages.config import build_config  # noqa: E402
from stages.demo import write_demo_model  # noqa: E402


def start_moto() -> tuple[subprocess.Popen, dict]:
    """moto's S3 server on a free port; returns (process, fsspec storage options)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    return proc, {"key": "testing", "secret": "testing",
                  "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def cache_url(root: Path, n: int, s3: dict | None) -> str:
    if s3 is None:
        return str(root / f"cache-{n}.zarr")
    import boto3

    bucket = f"scaling-{n}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1",
                 endpoint_url=s3["client_kwargs"]["endpoint_url"]).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/cache.zarr"


def run_workers(config_path: Path, n: int) -> tuple[float, float, list[dict]]:
    """N ``flows.cli preprocess --part K`` processes at once; (wall s, their CPU s, per-worker counts)."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "preprocess", str(config_path), "--part", str(k)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(n)]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    workers = []
    for k, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise RuntimeError(f"worker {k} failed ({p.returncode}): {err[-2000:]}")
        found = re.search(r"(\d+) encoded, (\d+) already cached", out)
        workers.append({"part": k, "encoded": int(found.group(1)), "reused": int(found.group(2))})
    return wall, cpu_s, workers


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--side", type=int, default=256)
    parser.add_argument("--s3", action="store_true", help="the cache on s3:// (moto's server) instead of a folder")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    moto, s3 = start_moto() if args.s3 else (None, None)
    report = {"cpus": os.cpu_count(), "images": args.images, "side": args.side,
              "cache": "s3 (moto)" if s3 else "shared folder", "runs": {}}
    try:
        metadata = write_dataset(root / "data", args.images, args.side)
        model = write_demo_model(root / "model")
        for n in (int(x) for x in args.workers.split(",")):
            cfg = build_config({"dataset": {"metadata_path": str(metadata), "max_pixels": args.side ** 2},
                                "model": {"family": "qwen_image", "path": str(model), "dtype": "float32"},
                                "cache": {"url": cache_url(root, n, s3), "storage_options": s3 or {}},
                                "preprocess": {"parts": n, "device": "cpu", "decode_workers": 1},
                                "output": {"path": str(root / f"out-{n}")}})
            load = os.getloadavg()[0]
            wall, cpu_s, workers = run_workers(cfg.save(root / f"config-{n}.toml"), n)
            entries = len(open_cache(cfg.cache_url, mode="r", storage_options=s3).keys())
            complete = preprocess.finalize(cfg).complete
            report["runs"][str(n)] = {"wall_s": round(wall, 2), "workers_cpu_s": round(cpu_s, 1),
                                      "load_average_before": round(load, 1), "workers": workers, "entries": entries,
                                      "each_entry_encoded_once": sum(w["encoded"] for w in workers) == entries
                                      and complete}
        base = report["runs"].get("1", {}).get("wall_s")
        for run in report["runs"].values():
            run["speedup_vs_1"] = round(base / run["wall_s"], 2) if base else None
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
    return emit(report, args.out)


if __name__ == "__main__":
    main()
