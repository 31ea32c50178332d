"""Where a training step's host time goes, from a py-spy profile of ``bench.offload`` workers (JSON).

    py-spy record --nonblocking --subprocesses --rate 100 --format raw -o spy.txt -- \\
        python3 -m bench.offload --cases qwen20b --qwen-rows fp8_budget_16gb --out qwen.json
    python3 -m bench.spy_summary spy.txt

Per worker (named by its row's flags), only the samples taken inside a training step count: the
main thread in ``Trainer.optimizer_step`` (forward, optimizer) and the autograd thread in
checkpoint recomputes and gradient hooks.  One-off costs inside a step are left out and counted
apart (Triton's first compile, diffusers' lazy pipeline import on the first step).  py-spy sees
Python frames only: the autograd thread's C++ work (most of backward) is not in these samples.
"""

from __future__ import annotations

import argparse
import collections
import json
import re

IN_STEP = ("Trainer.optimizer_step", "unpack_hook", "register_multi_grad_hook.<locals>.wrapped_fn")
ONE_OFF = ("triton_key", "JITFunction._do_compile", "_pipeline_cls")


def _name(frame: str) -> str:
    return re.sub(r":\d+\)", ")", frame)


def _worker(process: str) -> str | None:
    if "--worker qwen" not in process:
        return None
    if "--storage" in process:
        return "fp8"
    return "offload" if "--offload" in process else "resident"


def summarise(path: str, top: int = 15) -> dict:
    rows: dict[str, dict] = {}
    for line in open(path):
        stack, count = line.rstrip("\n").rsplit(" ", 1)
        frames = stack.split(";")
        worker = _worker(frames[1]) if len(frames) > 2 else None
        if worker is None or not any(k in f for f in frames for k in IN_STEP):
            continue
        row = rows.setdefault(worker, {"samples": 0, "one_off": 0, "offload": 0, "self": collections.Counter()})
        n = int(count)
        if any(k in f for f in frames for k in ONE_OFF):
            row["one_off"] += n
            continue
        row["samples"] += n
        row["offload"] += n if any("diffsynth_core/offload" in f for f in frames) else 0
        row["self"][_name(frames[-1])] += n
    return {worker: {"step_samples": r["samples"], "one_off_samples": r["one_off"],
                     "offload_share": r["offload"] / r["samples"] if r["samples"] else None,
                     "top_self": [[name, n, round(n / r["samples"], 3)] for name, n in r["self"].most_common(top)]}
            for worker, r in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="py-spy's --format raw output")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    print(json.dumps(summarise(a.raw, a.top), indent=1))


if __name__ == "__main__":
    main()
