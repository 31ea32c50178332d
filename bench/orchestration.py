"""What orchestration costs on the demo, measured side by side in one run; prints JSON.

* ``noop_run_s``: ``splitflow run`` on a finished demo (decided from disk, no Prefect), median;
  every figure is wall time of a fresh process (interpreter, imports and all), median of ``--repeats``;
* ``cli_run_s``: ``splitflow run`` of the demo from nothing (private Prefect server);
* ``direct_*_s`` vs ``cli_*_s``: each stage as a fresh process calling the stage functions
  directly, and as the CLI verb (Prefect flows, server start included); the difference is the
  per-stage overhead;
* ``pooled_run_default_s`` / ``pooled_run_tuned_s``: ``splitflow run --preprocess-pool cheap --train-pool big``
  from trigger to summary against a real ``prefect server start`` with one process worker per pool (limit 1):
  workers at Prefect's default polling (``PREFECT_WORKER_QUERY_SECONDS`` 10 s, coordinator ``poll_s`` 2 s),
  then tuned (1 s and ``orchestration.poll_s=1``), in turn, each from nothing (fresh cache and output),
  medians of ``--repeats``; ``stage_runs_waiting_s``: per run, its stage runs' seconds from submission to
  Running (a pool slot, the worker's poll, a fresh process, the flow loading), summed.

Usage: ``python bench/orchestration.py [--workdir DIR] [--repeats 3] [--no-pools]`` from the repo root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stages.demo import demo_config, write_demo_dataset, write_demo_model  # noqa: E402

DIRECT = """
import sys
from stages.config import load_config
from stages import preprocess, train
cfg = load_config(sys.argv[1])
if sys.argv[2] == "preprocess":  # what the CLI's preprocess does: every part, then finalize
    for part in range(cfg.preprocess.parts):
        preprocess.run(cfg, part)
    preprocess.finalize(cfg)
else:
    train.run(cfg)
"""


def _config(assets: Path, workdir: Path) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = demo_config(workdir, overrides=[f"dataset.base_path={assets / 'dataset'}", f"model.path={assets / 'model'}",
                                          f"dataset.metadata_path={assets / 'dataset' / 'metadata.csv'}"])
    return cfg.save(workdir / "demo.toml")


def _timed(args: list, env: dict) -> float:
    started = time.perf_counter()
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{result.stderr[-3000:]}")
    return round(elapsed, 2)


# What a user sets to bring a pooled run's latency down: workers poll for runs every second (Prefect's default
# is 10 s), and the coordinator reads run states every second (orchestration.poll_s, default 2 s).
POLLING = (("default", 10, ["--set", "orchestration.poll_s=2"]), ("tuned", 1, ["--set", "orchestration.poll_s=1"]))


def _cli(*args: str) -> list:
    return [sys.executable, "-m", "flows.cli", *args]


def _waits(cluster, name: str) -> float:
    """Seconds the stage runs of ``name`` spent from submission to Running (a slot, the worker's poll, a process
    starting, the flow loading), summed, from the server's records."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with cluster.client() as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{name}"])))
    return round(sum((run.start_time - run.created).total_seconds() for run in runs
                     if run.name != name and run.start_time), 1)


def _pooled(assets: Path, root: Path, env: dict, repeats: int) -> dict:
    """The pooled demo on one server, workers at Prefect's default polling and tuned, in turn, each run from
    nothing (fresh cache and output)."""
    from tests.flows.pool_cluster import Cluster

    cluster = Cluster(root / "cluster")
    cluster.env.pop("PREFECT_WORKER_PREFETCH_SECONDS")  # Prefect's default (10 s) for both
    runs, waits = {label: [] for label, _, _ in POLLING}, {label: [] for label, _, _ in POLLING}
    try:
        started = time.perf_counter()
        cluster.start_server()
        server_s = round(time.perf_counter() - started, 2)
        for pool in ("cheap", "big"):
            cluster.create_pool(pool, limit=1)
        for repeat in range(repeats):  # alternating: a machine getting busier weighs on both alike
            for label, query_s, overrides in POLLING:
                cluster.env["PREFECT_WORKER_QUERY_SECONDS"] = str(query_s)
                for pool in ("cheap", "big"):
                    cluster.start_worker(pool)
                name = f"pooled-{label}-{repeat}"
                command = _cli("run", str(_config(assets, root / name)), "--name", name, "--preprocess-pool",
                               "cheap", "--train-pool", "big", *overrides)
                runs[label].append(_timed(command, {**env, **{k: v for k, v in cluster.env.items()
                                                             if k.startswith("PREFECT")}}))
                waits[label].append(_waits(cluster, name))
                cluster.stop_workers()
    finally:
        cluster.close()
    return {**{f"pooled_run_{label}_s": round(statistics.median(values), 2) for label, values in runs.items()},
            "pooled_runs_s": runs, "stage_runs_waiting_s": waits, "prefect_server_start_s": server_s,
            "polling": {label: [f"PREFECT_WORKER_QUERY_SECONDS={query_s}", overrides[1]]
                        for label, query_s, overrides in POLLING},
            "pool_concurrency_limit": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-pools", action="store_true")
    args = parser.parse_args()
    load_at_start = round(os.getloadavg()[0], 2)  # figures are wall times: say how busy the machine was
    root = Path(args.workdir or tempfile.mkdtemp(prefix="splitflow-bench-orch-"))
    assets = root / "assets"
    write_demo_dataset(assets / "dataset")
    write_demo_model(assets / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env.update(HF_HUB_OFFLINE="1", DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")

    _timed(_cli("status", str(_config(assets, root / "warm"))), env)  # file digests, page cache, imports
    stages = {"direct_preprocess_s": [], "cli_preprocess_s": [], "direct_train_s": [], "cli_train_s": []}
    for repeat in range(args.repeats):  # side by side, alternating, fresh output folders each time
        direct, verbs = _config(assets, root / f"direct{repeat}"), _config(assets, root / f"verbs{repeat}")
        stages["direct_preprocess_s"].append(_timed([sys.executable, "-c", DIRECT, str(direct), "preprocess"], env))
        stages["cli_preprocess_s"].append(_timed(_cli("preprocess", str(verbs)), env))
        stages["direct_train_s"].append(_timed([sys.executable, "-c", DIRECT, str(direct), "train"], env))
        stages["cli_train_s"].append(_timed(_cli("train", str(verbs)), env))
    result = {key: round(statistics.median(values), 2) for key, values in stages.items()}
    result["overhead_preprocess_s"] = round(result["cli_preprocess_s"] - result["direct_preprocess_s"], 2)
    result["overhead_train_s"] = round(result["cli_train_s"] - result["direct_train_s"], 2)
    full = _config(assets, root / "full")
    result["cli_run_s"] = _timed(_cli("run", str(full)), env)
    result["noop_run_s"] = statistics.median(_timed(_cli("run", str(full)), env) for _ in range(3))
    if not args.no_pools:
        result.update(_pooled(assets, root, env, args.repeats))
        for label in ("default", "tuned"):
            result[f"pooled_overhead_{label}_s"] = round(result[f"pooled_run_{label}_s"] - result["direct_preprocess_s"]
                                                         - result["direct_train_s"], 2)
    result.update(demo="16 images, 2 parts, 32 LoRA steps, validation images at 16 and 32 (tiny Qwen-Image), CPU",
                  cpus=os.cpu_count(), load_average_1m={"start": load_at_start, "end": round(os.getloadavg()[0], 2)},
                  workdir=str(root))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
