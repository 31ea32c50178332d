"""Where a stack step's GPU time goes, resident against our engine's rows, from a profiler trace.

    python -m bench.gpu_timeline --modes resident,budget_12_of_24_act:4.8546,static_12_of_24_act:2.6374

Each ``MODE[:BUDGET_GIB]`` is set up as ``bench/interleaved.py`` sets it up (one model, one process,
one after the other), warmed up, then ``--steps`` steps run under ``torch.profiler``.  From the
trace, per mode (medians over the profiled steps, milliseconds): the step's wall time; the compute
stream's busy time (the union of its kernels) and its idle gaps, split into those that end as a
host->device copy lands (compute waited for a copy) and the rest (compute waited for the host);
the first kernel's delay after the step starts and the idle tail after its last kernel; and the
kernels' time by kind, so that a slower kernel shows apart from a wait.  Prints one JSON document.
``--size tiny --device cpu`` checks the script without a GPU (no kernels: only wall times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from types import SimpleNamespace

import torch

from bench.dit_stack import SIZES, build, stack_step
from bench.interleaved import side

GAP_MS = 0.005  # idle stretches of the compute stream shorter than this are launch spacing, not waits


def profiled_steps(step, device, steps: int) -> dict:
    """Run ``step`` ``steps`` times under the profiler, each in a ``stack_step`` range; the trace."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            with torch.profiler.record_function("stack_step"):
                float(step())
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def kernel_kind(name: str) -> str:
    """Coarse kinds, enough to see whether matmuls, attention or element-wise kernels got slower."""
    low = name.lower()
    for kind, marks in (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
                        ("attention", ("flash", "fmha", "attention", "sdpa")),
                        ("norm", ("norm",)), ("copy", ("copy", "cast", "to_copy"))):
        if any(m in low for m in marks):
            return kind
    return "elementwise_other"


def analyse(trace: dict) -> list[dict]:
    """One record per ``stack_step`` range (times in ms, relative to the range's start)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("name") == "stack_step" and e.get("cat") == "user_annotation")
    kernels = [e for e in events if e.get("cat") == "kernel"]
    h2d = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    by_stream: dict[int, float] = {}
    for k in kernels:
        by_stream[k["args"].get("stream")] = by_stream.get(k["args"].get("stream"), 0.0) + k["dur"]
    compute = max(by_stream, key=by_stream.get) if by_stream else None
    out = []
    for t0, t1 in steps:
        mine = [k for k in kernels if k["args"].get("stream") == compute and t0 <= k["ts"] < t1]
        busy = merged([(k["ts"], k["ts"] + k["dur"]) for k in mine])
        copies_landed = sorted(c["ts"] + c["dur"] for c in h2d if t0 <= c["ts"] < t1)
        rec = {"wall_ms": (t1 - t0) / 1e3, "kernels": len(mine),
               "h2d_copies": len(copies_landed),
               "h2d_gb": sum(c["args"].get("bytes", 0) for c in h2d if t0 <= c["ts"] < t1) / 1e9,
               "h2d_copy_ms": sum(c["dur"] for c in h2d if t0 <= c["ts"] < t1) / 1e3}
        if rec["h2d_copy_ms"]:  # the bandwidth each copy got while it ran (bytes over its own duration)
            rec["h2d_gb_s_while_copying"] = rec["h2d_gb"] / (rec["h2d_copy_ms"] / 1e3)
        if busy:
            gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if (b[0] - a[1]) / 1e3 > GAP_MS]
            # a gap that ends within 20 us after a copy landed: compute was waiting for that copy
            waited_copy = [(a, b) for a, b in gaps if any(a <= land <= b + 20 for land in copies_landed)]
            rec.update(
                busy_ms=sum(b - a for a, b in busy) / 1e3,
                first_kernel_ms=(busy[0][0] - t0) / 1e3, tail_ms=(t1 - busy[-1][1]) / 1e3,
                gaps=len(gaps), gap_ms=sum(b - a for a, b in gaps) / 1e3,
                gap_copy_ms=sum(b - a for a, b in waited_copy) / 1e3, gaps_copy=len(waited_copy),
                largest_gaps_ms=[[round((a - t0) / 1e3, 2), round((b - a) / 1e3, 3), (a, b) in waited_copy]
                                 for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:12]],
                kernel_ms_by_kind={})
            for k in mine:
                kind = kernel_kind(k["name"])
                rec["kernel_ms_by_kind"][kind] = rec["kernel_ms_by_kind"].get(kind, 0.0) + k["dur"] / 1e3
        out.append(rec)
    return out


def summary(records: list[dict]) -> dict:
    """Medians of the numeric figures over the profiled steps, and the last step's largest gaps."""
    out = {}
    for key, value in records[-1].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in records)
        elif key == "kernel_ms_by_kind":
            out[key] = {kind: statistics.median(r[key].get(kind, 0.0) for r in records) for kind in value}
    out["largest_gaps_ms_last_step"] = records[-1].get("largest_gaps_ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", required=True, type=lambda v: v.split(","),
                    help="MODE[:BUDGET_GIB],...: resident, resident_act, or a side_by_side row")
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="each mode profiled this many times, in turn")
    a = ap.parse_args()
    from diffsynth_core.training.device import avoid_broken_kernels

    device = avoid_broken_kernels(a.device)
    model, x = build(a.size, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda")
    results: dict[str, list] = {}
    for _ in range(a.rounds):
        for spec in a.modes:
            mode, _, budget = spec.partition(":")
            args = SimpleNamespace(size=a.size, budget_gib=float(budget) if budget else None, copy_gib=0.0)
            with side(model, device, mode, args) as mgr:
                step = stack_step(model, x, opt, mgr)
                for _ in range(a.warmup):
                    step()
                figures = summary(analyse(profiled_steps(step, device, a.steps)))
                if mgr is not None:
                    figures["h2d_gb_engine"] = mgr.report()["last_step_h2d_bytes"] / 1e9
            results.setdefault(mode, []).append(figures)
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "size": dict(zip(("blocks", "width", "tokens"), SIZES[a.size])), "modes": results}, indent=1))


if __name__ == "__main__":
    main()
