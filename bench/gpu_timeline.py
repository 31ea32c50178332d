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
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.dit_stack import SIZES, build, stack_step, timed_steps
from bench.interleaved import side
from bench.offload import StepProfiler


def profiled_step(step, device: torch.device, warmup: int, min_gap_us: float, keep: Path | None = None) -> dict:
    """``warmup`` steps, then one profiled step: its wall time and its trace's summary (``keep``:
    its device events and runtime calls written there too)."""
    if warmup:
        timed_steps(step, device, warmup, 0)
    profiler = StepProfiler(warmup, min_gap_us)
    profiler.after_step(warmup)  # starts the profiler
    wall = timed_steps(step, device, 1, 0)["step_s"]
    profiler.after_step(warmup + 1)  # stops it
    return {"wall_ms": wall * 1e3, **(profiler.summary(keep) or {})}


class HostLead:
    """Unprofiled: at each block's forward, how far the GPU ran behind the host.

    A marker (host clock + a CUDA event) before the engine's pre-hook (``pre``) and one after it
    (``in``, where the block's own kernels start being queued).  The GPU reaches a marker ``lead``
    ms after the host queued it; a lead near 0 means the GPU had run dry and waited for the host.
    ``in`` minus ``pre`` on the host clock is what the engine's hook cost there.  Forward only
    (no recompute): backward's kernels are long, and the host runs far ahead there."""

    def __init__(self, blocks):
        self.marks: list[tuple[int, str, float, object]] = []
        self.handles = [h for i, b in enumerate(blocks) for h in (
            b.register_forward_pre_hook(self._marker(i, "pre"), prepend=True),
            b.register_forward_pre_hook(self._marker(i, "in")))]

    def _marker(self, i: int, where: str):
        def hook(module, args):
            if torch._C._current_graph_task_id() == -1:  # forward, not a recompute inside backward
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append((i, where, time.perf_counter(), event))
        return hook

    def step(self, step) -> dict:
        """One step with markers: per block, its ``pre``/``in`` leads (ms) and the engine hook's host µs."""
        torch.cuda.synchronize()
        self.marks = []
        start = torch.cuda.Event(enable_timing=True)
        start.record()  # the GPU is idle: it reaches this at once
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        rows: dict[int, dict] = {}
        for i, where, host_t, event in self.marks:
            host_ms = (host_t - t0) * 1e3
            rows.setdefault(i, {})[where] = (start.elapsed_time(event) - host_ms, host_ms)
        return {"lead_pre_ms": [round(r["pre"][0], 3) for r in rows.values()],
                "lead_in_ms": [round(r["in"][0], 3) for r in rows.values()],
                "hook_us": [round((r["in"][1] - r["pre"][1]) * 1e3, 1) for r in rows.values()],
                "host_ms": [round(r["pre"][1], 3) for r in rows.values()]}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def lead_steps(step, model, steps: int) -> dict:
    """``steps`` steps with ``HostLead`` markers: per step, the smallest lead, how many blocks' kernels
    found the GPU waiting (lead < 0.05 ms), and the engine hook's median host µs; the median step's rows."""
    lead = HostLead(model.blocks)
    try:
        runs = [lead.step(step) for _ in range(steps)]
    finally:
        lead.remove()
    summary = [{"min_lead_ms": min(r["lead_in_ms"]), "starved_blocks": sum(v < 0.05 for v in r["lead_in_ms"]),
                "hook_us_median": statistics.median(r["hook_us"])} for r in runs]
    return {"steps": summary, "median_step": runs[len(runs) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", required=True, type=lambda v: v.split(","),
                    help="MODE[:BUDGET_GIB],...: resident, resident_act, resident_copies_act (with --copy-gib: "
                    "a row's bytes beside resident compute), or a side_by_side row")
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="each mode profiled this many times, in turn")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--copy-gib", type=float, default=0.0,
                    help="resident_copies[_gated][_act] modes (bench/interleaved.py): GiB a copy, e.g. 0.1758, "
                    "the 12-of-24 row's weight bytes a step / 24 (its floor)")
    ap.add_argument("--lead-steps", type=int, default=0,
                    help="CUDA: after each profiled step, this many unprofiled steps with HostLead markers")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="keep each profiled step's device events and runtime calls there (MODE_ROUND.json.gz)")
    a = ap.parse_args()
    if any(m.startswith("resident_copies") for m in a.modes) and a.copy_gib <= 0:
        ap.error("a resident_copies mode needs --copy-gib (GiB a copy)")
    from diffsynth_core.training.device import avoid_broken_kernels

    device = avoid_broken_kernels(a.device)
    model, x = build(a.size, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda")
    results: dict[str, list] = {}
    if a.trace_dir is not None:
        a.trace_dir.mkdir(parents=True, exist_ok=True)
    for round_ in range(a.rounds):
        for spec in a.modes:
            mode, _, budget = spec.partition(":")
            args = SimpleNamespace(size=a.size, budget_gib=float(budget) if budget else None, copy_gib=a.copy_gib)
            with side(model, device, mode, args) as (mgr, copies):
                keep = a.trace_dir / f"{mode}_{round_}.json.gz" if a.trace_dir is not None else None
                figures = profiled_step(stack_step(model, x, opt, mgr), device, a.warmup, a.min_gap_us, keep)
                if a.lead_steps and device.type == "cuda":
                    figures["lead"] = lead_steps(stack_step(model, x, opt, mgr), model, a.lead_steps)
                if copies is not None:  # over the warm-up, profiled and lead steps, as the row's h2d_gb
                    figures["h2d_gb"] = copies.gb_per_step(a.warmup + 1 + ("lead" in figures) * a.lead_steps)
                if mgr is not None:
                    figures["h2d_gb"] = mgr.report()["last_step_h2d_bytes"] / 1e9
                    figures["resident_at"] = sorted(u.index for u in mgr.plan.budget)
            results.setdefault(mode, []).append(figures)
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "size": dict(zip(("blocks", "width", "tokens"), SIZES[a.size])), "modes": results}, indent=1))


if __name__ == "__main__":
    main()
