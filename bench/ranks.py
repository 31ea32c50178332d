"""Offloaded training on every GPU of a node: host RAM and samples/s for 1 rank vs all ranks, side by side.

    python -m bench.ranks --workdir /tmp/ranks [--dit-layers 20] [--images 8] [--pixels 1024] [--steps 14]
                          [--warmup 4] [--ranks 1,all] [--set offload.vram_budget_gb=0 ...] [--out FILE]
    python -m bench.ranks --smoke          # tiny model, 2 gloo ranks on the CPU (checks the code path)

Builds a random Qwen-Image model folder with ``bench/e2e_gpu.py`` (the DiT at the released width,
``--dit-layers`` deep), encodes ``--images`` photos once (``flows.cli preprocess --part 0``), then
for each rank count N runs what a user runs on a node,
``torchrun --standalone --nproc-per-node N -m flows.cli train CONFIG --in-process`` with
``offload.enable_model_cpu_offload = true`` (every block streamed from the host copy unless
``--set offload.vram_budget_gb=...``), while this process samples every 0.1 s

* the machine's used memory, ``MemTotal - MemAvailable`` (``/proc/meminfo``) minus the baseline
  taken just before the launch: the shared ``/dev/shm`` copy is counted once here;
* every 0.5 s the sum of the launched processes' PSS (``/proc/PID/smaps_rollup``; shared pages
  are split between the ranks mapping them) and each rank's RSS (which counts a shared copy in
  every rank: shown to make that visible, not as a measure).

Both are reported over the whole run (model load included) and over the training phase (from the
first row of ``metrics.csv`` on), against the DiT's bytes.  samples/s comes from rank 0's
``metrics.csv`` over the steps after ``--warmup``: samples / step time (rank 0's row counts every
rank's samples of the step).  ``scaling_vs_linear`` = samples/s(N) / (N x samples/s(1)).
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import e2e_gpu  # noqa: E402  (the model folder, dataset and config builders)

GB = 1e9


# --- sampling host memory ------------------------------------------------------------------------
def machine_used_bytes() -> int:
    """MemTotal - MemAvailable: what the machine cannot hand out (shared memory included, page cache not)."""
    fields = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class HostSampler:
    """Peaks of the machine's used memory (10 Hz) and of the launched tree's PSS sum (2 Hz), split
    at the moment ``training_started()`` first answers True."""

    def __init__(self, pid: int, training_started):
        import psutil

        self.root, self.psutil, self.training_started = psutil.Process(pid), psutil, training_started
        self.baseline = machine_used_bytes()
        self.peak = {"all": {"used": 0, "pss": 0}, "training": {"used": 0, "pss": 0}}
        self.rank_rss: dict[int, dict[str, int]] = {}  # pid -> peak of each /proc/PID/status Rss* field
        self.training_at: float | None = None
        self.samples = 0
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.1):
            tick += 1
            phases = ["all"]
            if self.training_at is None and tick % 5 == 0 and self.training_started():
                self.training_at = time.perf_counter() - self._t0
            if self.training_at is not None:
                phases.append("training")
            used = machine_used_bytes() - self.baseline
            pss = self._tree_pss() if tick % 5 == 0 else 0
            for phase in phases:
                self.peak[phase]["used"] = max(self.peak[phase]["used"], used)
                self.peak[phase]["pss"] = max(self.peak[phase]["pss"], pss)
            self.samples += 1

    def _tree_pss(self) -> int:
        total = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except self.psutil.Error:
            return 0
        for proc in procs:
            try:
                total += pss_bytes(proc.pid)
                if proc is not self.root:
                    peaks = self.rank_rss.setdefault(proc.pid, {})
                    for name, value in e2e_gpu.rss_fields(proc.pid).items():
                        peaks[name] = max(peaks.get(name, 0), value)
            except (OSError, self.psutil.Error):  # a rank that just exited
                continue
        return total

    def stop(self, dit_bytes: int) -> dict:
        self._stop.set()
        self._thread.join()
        out = {"baseline_used_gb": self.baseline / GB, "samples": self.samples, "training_from_s": self.training_at}
        for phase, peak in self.peak.items():
            out[phase] = {"used_gb": peak["used"] / GB, "used_over_dit": peak["used"] / dit_bytes,
                          "pss_sum_gb": peak["pss"] / GB, "pss_sum_over_dit": peak["pss"] / dit_bytes}
        # per rank: RssAnon is its private memory, RssShmem its mapping of the shared copy, RssFile libraries
        out["rank_rss_peak_gb"] = [{k: round(v / GB, 3) for k, v in peaks.items()} for peaks in self.rank_rss.values()]
        return out


# --- one rank count ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics_rows(path: Path) -> list[dict]:
    from diffsynth_core.training.metrics import read_metrics

    try:
        return read_metrics(path) if path.is_file() else []
    except (OSError, ValueError, KeyError):  # a row being written
        return []


def train_with(nprocs: int, config: Path, out: Path, overrides: list[str], dit_bytes: int, warmup: int,
               env: dict) -> dict:
    metrics = out / "metrics.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "flows.cli", "train", str(config), "--in-process", "--set", f"output.path={out}",
           *[arg for s in overrides for arg in ("--set", s)]]
    time.sleep(1.0)  # let the previous run's memory go back before the baseline is taken
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = HostSampler(proc.pid, lambda: len(_metrics_rows(metrics)) > 0)
    output = proc.communicate()[0]
    wall = time.perf_counter() - started
    host = sampler.stop(dit_bytes)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun with {nprocs} rank(s) failed ({proc.returncode}):\n{output[-4000:]}")
    rows = _metrics_rows(metrics)[warmup:]
    if not rows:
        raise SystemExit(f"{metrics}: no step after the first {warmup}; raise --steps")
    step_s = sum(float(r["step_time_s"]) for r in rows)
    samples = sum(int(r["samples"]) for r in rows)
    report = json.loads((out / "offload.json").read_text())
    # what each rank adds besides the host copy (torch, CUDA context, loader): extrapolates to other DiT sizes
    host["training"]["beyond_arena_per_rank_gb"] = (host["training"]["used_gb"] - report["arena_bytes"] / GB) / nprocs
    return {"ranks": nprocs, "wall_s": round(wall, 2), "steps_measured": len(rows),
            "s_per_step": round(step_s / len(rows), 4), "samples_per_step": samples / len(rows),
            "samples_per_s": round(samples / step_s, 3),  # a row's samples are the whole step's, every rank's
            "host": host, "arena_bytes": report["arena_bytes"], "arena_shared": report.get("arena_shared"),
            "pinned": report["pinned"], "h2d_gb_per_step": report["last_step_h2d_bytes"] / GB,
            "resident_units": report["budget_units"], "streamed_units": report["streamed_units"],
            "share_warnings": [line for line in output.splitlines() if "cannot share" in line][:4]}


# --- what a rank costs before any weight ----------------------------------------------------------
def probe() -> None:
    """Run by each rank of ``torchrun -m bench.ranks --probe``: this process's RssAnon (private host
    memory) after each thing a training rank sets up before it loads a weight; one JSON line."""
    steps = {"python+torch": e2e_gpu.rss_fields(os.getpid())}
    import flows.cli  # noqa: F401  what `flows.cli train --in-process` imports
    from stages import train  # noqa: F401
    from stages.common import init_distributed

    steps["training_modules"] = e2e_gpu.rss_fields(os.getpid())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        from diffsynth_core.training.device import avoid_broken_kernels

        avoid_broken_kernels(device)
    device = init_distributed(device)
    torch.zeros(1, device=device)
    steps["device_context"] = e2e_gpu.rss_fields(os.getpid())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(torch.ones(1 << 20, device=device))
    steps["process_group"] = e2e_gpu.rss_fields(os.getpid())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 24, 4096, 128, device=device, dtype=dtype, requires_grad=True)
    torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    (torch.randn(3072, 3072, device=device, dtype=dtype) @ torch.randn(3072, 3072, device=device, dtype=dtype)).sum()
    torch.cuda.synchronize() if device.type == "cuda" else None
    steps["attention+matmul"] = e2e_gpu.rss_fields(os.getpid())
    print("PROBE " + json.dumps({step: {k: round(v / GB, 3) for k, v in f.items()} for step, f in steps.items()}))


def bare_ranks(nprocs: int, env: dict) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), "-m", "bench.ranks", "--probe"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line.split("PROBE ", 1)[1] for line in done.stdout.splitlines() if "PROBE " in line]
    return [json.loads(line) for line in lines] or [{"error": done.stderr[-1500:]}]


# --- the whole benchmark -------------------------------------------------------------------------
def prepare(workdir: Path, a) -> tuple[Path, int]:
    """Model folder, dataset, config, and the cache encoded once; returns (config, DiT bytes)."""
    build = [sys.executable, "-m", "bench.e2e_gpu", "--build-only", "--workdir", str(workdir),
             "--dit-layers", str(a.dit_layers), "--te-layers", "1"] + (["--quick"] if a.smoke else [])
    subprocess.run(build, cwd=ROOT, check=True)
    meta = e2e_gpu.write_dataset(workdir / "dataset", a.images, a.pixels)
    config = e2e_gpu.write_config(workdir, meta, a.steps, a.pixels, a.smoke)
    encode = [sys.executable, "-m", "flows.cli", "preprocess", str(config), "--part", "0",
              *[arg for s in a.set for arg in ("--set", s)]]
    subprocess.run(encode, cwd=ROOT, check=True, env=_env(a.smoke))
    return config, e2e_gpu.dit_bytes(a.dit_layers, a.smoke)


def _env(smoke: bool) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if smoke:
        env["OMP_NUM_THREADS"] = "1"  # 2 ranks on a small CPU machine
    return env


def _rank_counts(spec: str, smoke: bool) -> list[int]:
    every = 2 if smoke else max(1, torch.cuda.device_count())
    return sorted({every if part == "all" else int(part) for part in spec.split(",")})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/splitflow-ranks")
    ap.add_argument("--dit-layers", type=int, default=20)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--pixels", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of samples/s")
    ap.add_argument("--ranks", default="1,all", help="rank counts to compare (all: every GPU)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 gloo ranks on the CPU")
    ap.add_argument("--set", action="append", default=[], help="extra `--set` overrides for every run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe-only", action="store_true", help="only the bare ranks' host memory (no model)")
    a = ap.parse_args()
    if a.probe:
        return probe()
    if a.probe_only:
        n = _rank_counts(a.ranks, a.smoke)[-1]
        return print(json.dumps({"bare_ranks": {str(n): bare_ranks(n, _env(a.smoke))}}, indent=1))
    if a.smoke:
        a.pixels, a.images, a.steps, a.warmup = 64, 4, 4, 1
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    config, dit = prepare(workdir, a)
    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not a.smoke else "cpu",
           "gpus": torch.cuda.device_count(), "dit_gb": dit / GB, "prepare_s": round(time.perf_counter() - t0, 1),
           "dev_shm_free_gb": _shm_free() / GB, "runs": {}}
    for n in _rank_counts(a.ranks, a.smoke):
        out["runs"][str(n)] = train_with(n, config, workdir / f"out-{n}", a.set, dit, a.warmup, _env(a.smoke))
        _save(out, a.out)
    n = max(int(k) for k in out["runs"])
    out["bare_ranks"] = {str(n): bare_ranks(n, _env(a.smoke))}  # where a rank's own host memory goes
    one = out["runs"].get("1")
    for n, run in out["runs"].items():
        if one and n != "1":
            run["scaling_vs_linear"] = round(run["samples_per_s"] / (int(n) * one["samples_per_s"]), 3)
    out["settings"] = {"dit_layers": a.dit_layers, "images": a.images, "pixels": a.pixels, "steps": a.steps,
                       "warmup": a.warmup, "set": a.set, "smoke": a.smoke}
    _save(out, a.out)
    print(json.dumps(out, indent=1))


def _shm_free() -> int:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def _save(out: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
