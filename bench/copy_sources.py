"""What host->device copies cost the compute beside them, by the host memory they read (a diagnosis
of issue 12's 12-of-24 row, whose copies cost its kernels ~0.5-1 % more than copies of one
``cudaHostAlloc`` buffer did).

The 24x3072 stack runs resident; at every block's forward and recompute a side stream copies one
block's bytes (``--copy-gib``) into a scratch buffer compute never reads, from one of these host
sources (a different region each time where there are several):

- ``none``: no copies (the baseline of each round);
- ``hostalloc_one`` / ``hostalloc_many``: ``pin_memory`` (``cudaHostAlloc``), one block / 12 blocks;
- ``register_one`` / ``register_many``: a plain host tensor page-locked in place with
  ``cudaHostRegister``, as the engine's ``HostArena`` is (4 KiB pages unless the system's
  transparent huge pages are "always");
- ``register_thp_many``: the same, its memory advised ``MADV_HUGEPAGE`` (2 MiB pages) before it is
  touched.

Every source is built once; each round runs every kind (rotated order), and a kind's ratio is its
step time over ``none``'s in the same round.  Prints JSON: per kind the median of its round ratios,
its pooled ratio, and the system's huge-page setting and how many huge pages each source got.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import statistics
import sys

import torch

from bench.dit_stack import build, hook_every_use, stack_step, timed_steps

HUGE = 2 << 20


def anon_huge_kib() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def registered(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` page-locked in place (as ``HostArena.pin``)."""
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    assert int(getattr(err, "value", err)) == 0, f"cudaHostRegister: {err}"
    return buffer


def thp_buffer(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """``nbytes`` of anonymous memory advised MADV_HUGEPAGE, starting 2 MiB-aligned (not touched)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared is shmem, no THP
    m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE
    return whole.narrow(0, skip, nbytes), m


def sources(kind: str, nbytes: int, count: int, keep: list) -> tuple[list[torch.Tensor], int]:
    """The host regions ``kind`` copies from, filled, and the huge pages (KiB) they took."""
    many = count if kind.endswith("_many") else 1
    before = anon_huge_kib()
    if kind.startswith("hostalloc"):
        buffer = torch.empty(many * nbytes, dtype=torch.uint8, pin_memory=True)
    elif kind == "register_thp_many":
        buffer, m = thp_buffer(many * nbytes)
        keep.append(m)
    else:
        buffer = torch.empty(many * nbytes, dtype=torch.uint8)
    buffer.fill_(1)  # touched, as weights copied in would be
    huge = anon_huge_kib() - before
    if kind.startswith("register"):
        registered(buffer)
    return [buffer.narrow(0, i * nbytes, nbytes) for i in range(many)], huge


def copy_hooks(model, regions: list[torch.Tensor], scratch: torch.Tensor, side: torch.cuda.Stream) -> list:
    """At every block's forward and recompute (``hook_every_use``), one copy from the next region, on ``side``."""
    turn = itertools.count()

    def copy(_module, _args):
        with torch.cuda.stream(side):
            scratch.copy_(regions[next(turn) % len(regions)], non_blocking=True)
    return [hook_every_use(block, copy) for block in model.blocks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="none,hostalloc_one,register_many,register_thp_many")
    ap.add_argument("--copy-gib", type=float, default=0.2110)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from diffsynth_core.gradient import apply_gradient_checkpointing
    from diffsynth_core.training.device import avoid_broken_kernels

    device = avoid_broken_kernels("cuda")
    model, x = build("full", device)
    apply_gradient_checkpointing(model, ("blocks",))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    nbytes, kinds, keep = int(args.copy_gib * 2**30), args.kinds.split(","), []
    built = {k: sources(k, nbytes, len(model.blocks) // 2, keep) for k in kinds if k != "none"}
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    rounds = []
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        times = {}
        for kind in order:
            hooks = copy_hooks(model, built[kind][0], scratch, side) if kind != "none" else []
            times[kind] = timed_steps(stack_step(model, x, opt, None), device, args.steps, args.warmup)
            for hook in hooks:
                hook.remove()
        rounds.append({k: t["step_s"] for k, t in times.items()})
        print(f"round {r}: {rounds[-1]}", file=sys.stderr)
    print(json.dumps({
        "thp_setting": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
        "copy_gib": args.copy_gib, "rounds": rounds,
        "huge_kib": {k: v[1] for k, v in built.items()},
        "median_ratio": {k: statistics.median(r[k] / r["none"] for r in rounds) for k in kinds},
        "pooled_ratio": {k: statistics.median(r[k] for r in rounds) / statistics.median(r["none"] for r in rounds)
                         for k in kinds},
    }))


if __name__ == "__main__":
    main()
