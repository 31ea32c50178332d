"""Where a stack step's GPU time goes, resident against our engine's rows, in one process.

    python -m bench.gpu_timeline --modes resident,budget_12_of_24_act:4.8546,static_12_of_24_act:2.6374

Each ``MODE[:BUDGET_GIB]`` is set up as ``bench/interleaved.py`` sets it up (one model, one process,
the modes in turn, ``--rounds`` times), warmed up, and one step is profiled and summarised by
``bench/offload.py``'s ``trace_summary``: per CUDA stream its busy time, and for the compute
stream its idle gaps (from ``--min-gap-us``), how busy the copy streams were inside them (compute
waiting for a copy) and the CUDA runtime calls the host sat in meanwhile.  Set beside the same
figures of the resident step, a slower kernel shows apart from a wait.  Prints one JSON document;
``--size tiny --device cpu`` checks the script without a GPU (no CUDA streams to summarise).
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from bench.dit_stack import SIZES, build, stack_step, timed_steps
from bench.interleaved import side
from bench.offload import StepProfiler


def profiled_step(step, device: torch.device, warmup: int, min_gap_us: float) -> dict:
    """``warmup`` steps, then one profiled step: its wall time and its trace's summary."""
    if warmup:
        timed_steps(step, device, warmup, 0)
    profiler = StepProfiler(warmup, min_gap_us)
    profiler.after_step(warmup)  # starts the profiler
    wall = timed_steps(step, device, 1, 0)["step_s"]
    profiler.after_step(warmup + 1)  # stops it
    return {"wall_ms": wall * 1e3, **(profiler.summary() or {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", required=True, type=lambda v: v.split(","),
                    help="MODE[:BUDGET_GIB],...: resident, resident_act, or a side_by_side row")
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="each mode profiled this many times, in turn")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
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
                figures = profiled_step(stack_step(model, x, opt, mgr), device, a.warmup, a.min_gap_us)
                if mgr is not None:
                    figures["h2d_gb"] = mgr.report()["last_step_h2d_bytes"] / 1e9
                    figures["resident_at"] = sorted(u.index for u in mgr.plan.budget)
            results.setdefault(mode, []).append(figures)
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "size": dict(zip(("blocks", "width", "tokens"), SIZES[a.size])), "modes": results}, indent=1))


if __name__ == "__main__":
    main()
