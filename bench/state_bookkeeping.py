"""Host time ``HostOptimizerState`` spends per step on its bookkeeping (no GPU needed).

    python3 -m bench.state_bookkeeping [--weights 2000] [--steps 20]

An AdamW over ``--weights`` tiny weights (two state tensors each, as a DiT's LoRA has thousands):
the copies cost next to nothing, so what is timed is the Python around them: the step's pre-hook
(copy in, point the state at views of one buffer) and post-hook (copy out, point it home).
Prints JSON: milliseconds per step for each hook (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from diffsynth_core.offload.optimizer_state import HostOptimizerState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    params = [nn.Parameter(torch.randn(4, 4)) for _ in range(a.weights)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    keeper = HostOptimizerState(optimizer)
    for p in params:
        p.grad = torch.ones_like(p)
    for _ in range(3):  # the state exists and has its pages
        optimizer.step()
    pre, post = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        keeper._bring_in(optimizer, (), {})
        t1 = time.perf_counter()
        keeper._send_out(optimizer, (), {})
        t2 = time.perf_counter()
        pre.append(t1 - t0)
        post.append(t2 - t1)
    print(json.dumps({"weights": a.weights, "state_tensors": 2 * a.weights,
                      "pre_hook_ms": 1e3 * statistics.median(pre), "post_hook_ms": 1e3 * statistics.median(post)}))


if __name__ == "__main__":
    main()
