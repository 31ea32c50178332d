"""What is on the GPU at a row's peak: one recorded step of ``bench/interleaved.py``'s row (a diagnosis).

    python -m bench.peak_composition --mode budget_12_of_24_act --budget-gib 4.8699

The row is set up as ``bench.interleaved.side`` sets it up, runs its warm-up steps, then one step
under ``torch.cuda.memory._record_memory_history``.  Replaying that step's allocator events finds the
moment ``memory_allocated`` peaks and what was alive then: what was already allocated when the step
began (resident blocks, slots, adapters and their optimizer state, ...) and the step's own tensors,
grouped by size (recording Python stacks fails in torch 2.11's backward: "run_backward returned
NULL"), with the allocations and frees just before the peak (which tensors they are shows where
in the step it falls).  Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from bench.dit_stack import LORA_INPUTS, build, stack_step
from bench.interleaved import side

MIB = 2**20


def replay(events: list[dict], start: int, before: int = 40) -> dict:
    """The peak of ``start`` + the step's allocations: the step's tensors alive at it (by size),
    and the ``before`` allocations and frees that led to it (MiB, frees negative)."""
    live, now, peak, at_peak, peak_at = {}, start, start, {}, 0
    changes = []  # MiB of every alloc (+) and free (-), in order
    for ev in events:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            now += ev["size"]
            changes.append(round(ev["size"] / MIB, 2))
            if now > peak:
                peak, at_peak, peak_at = now, dict(live), len(changes)
        elif ev["action"] == "free_requested" and ev["addr"] in live:  # where memory_allocated drops (a
            # block a side stream used is reused only at "free_completed", but counted free from here)
            now -= live.pop(ev["addr"])
            changes.append(-round(ev["size"] / MIB, 2))
    by_size: dict[float, int] = defaultdict(int)
    for size in at_peak.values():
        by_size[round(size / MIB, 2)] += 1
    return {"peak_mib": peak / MIB, "step_tensors_at_peak_mib": (peak - start) / MIB,
            "peak_at_change": peak_at, "changes_in_step": len(changes),
            "at_peak_by_size_mib": {f"{mib}": n for mib, n in sorted(by_size.items(), reverse=True)},
            "changes_before_peak_mib": changes[max(0, peak_at - before):peak_at],
            "changes_after_peak_mib": changes[peak_at:peak_at + 10]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora-input", choices=LORA_INPUTS, default="narrow")
    args = ap.parse_args()
    args.size, args.copy_gib = "full", 0.0
    from diffsynth_core.training.device import avoid_broken_kernels

    device = avoid_broken_kernels("cuda")
    model, x = build("full", device, lora_input=args.lora_input)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    with side(model, device, args.mode, args) as (mgr, _copies):
        step = stack_step(model, x, opt, mgr)
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(context=None, max_entries=200_000)
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        measured = torch.cuda.max_memory_allocated()
        figures = {"allocated_at_step_start_mib": start / MIB, "max_memory_allocated_mib": measured / MIB}
        if mgr is not None:
            figures["resident_units"] = mgr.report()["budget_units"]
            figures["slots_mib"] = len(mgr.streamer.slots) * mgr.streamer.slot_bytes / MIB
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    events = [ev for trace in snapshot["device_traces"] for ev in trace]
    print(json.dumps({"mode": args.mode, "budget_gib": args.budget_gib, **figures,
                      "trainable_mib": trainable / MIB, **replay(events, start)}))


if __name__ == "__main__":
    main()
