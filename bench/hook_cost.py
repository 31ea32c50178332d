"""Host time of the offload engine's per-use hook (``OffloadTrainingManager._use``) by storage dtype.

    python -m bench.hook_cost [--out FILE] [--profile]

An eager offloaded step is host-bound when the GPU runs close behind the host's launches (the
Qwen-Image 20 B step does: ``gpu_lag_ms`` in ``bench/results``), and then every microsecond a
streamed block's hook takes is step time.  This measures that cost alone: a toy whose blocks hold
32 tensors each, as a real-width Qwen-Image block does (16 Linear layers, LoRA on two), at a width
where the GPU never makes the host wait, every block streamed, trained with checkpointing; per
storage (bf16, ``packed_bfloat16``, fp8) the wall time inside the hook per use and the step time,
and for packed and fp8 again with their widenings launched eagerly instead of replayed as CUDA graphs
(``graphs: false``; packed and fp8 alike).
``--profile`` adds cProfile's costliest offload functions of the packed run (cumulative seconds
over the timed steps) and its costliest functions of any module by their own time (cProfile slows
every call, so compare them with each other, not with the unprofiled figures).  CUDA only.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch
from torch import nn

from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.offload import OffloadTrainingManager, packed, widening
from diffsynth_core.training.lora import inject_lora

TENSORS_PER_BLOCK = 32  # a real-width Qwen-Image block: 14 Linear weights, 14 biases, 4 norm scales


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(TENSORS_PER_BLOCK // 2))

    def forward(self, x):
        for lin in self.lins:
            x = x + lin(x)
        return x


class Stack(nn.Module):
    def __init__(self, d: int, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def measure(storage, d: int, n: int, steps: int, profile: bool, graphs: bool = True) -> dict:
    widening.GRAPHS = graphs  # False: widenings launched eagerly at every load, as before they were recorded
    torch.manual_seed(0)
    model = Stack(d, n).bfloat16()
    inject_lora(model, ["lins.0", "lins.5"], rank=4)
    apply_gradient_checkpointing(model, ("blocks",))
    mgr = OffloadTrainingManager(model, torch.device("cuda"), storage_dtype=storage)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = torch.randn(16, d, device="cuda").bfloat16()
    spent = {"s": 0.0, "uses": 0}
    real = OffloadTrainingManager._use

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            spent["s"] += time.perf_counter() - t
            spent["uses"] += 1

    OffloadTrainingManager._use = timed
    prof = cProfile.Profile() if profile else None
    warmup = steps // 2
    try:
        for step in range(steps):
            if step == warmup:  # the plan and the prefetch order are learnt by now
                torch.cuda.synchronize()
                spent.update(s=0.0, uses=0)
                start = time.perf_counter()
                if prof:
                    prof.enable()
            model(x).float().pow(2).mean().backward()
            mgr.after_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        if prof:
            prof.disable()
    finally:
        OffloadTrainingManager._use = real
    out = {"storage": str(storage), "use_us": 1e6 * spent["s"] / max(spent["uses"], 1),
           "uses_per_step": spent["uses"] / (steps - warmup), "step_ms": 1e3 * wall / (steps - warmup),
           "h2d_copies": mgr.report()["h2d_copies"]}
    mgr.detach()
    if prof:
        stats = pstats.Stats(prof)
        rows = [(f"{Path(f).name}:{line}({fn})", ct) for (f, line, fn), (_, _, _, ct, _) in stats.stats.items()
                if "offload" in f or "triton" in f]
        out["profile_cumulative_s"] = [[name, round(ct, 4)] for name, ct in sorted(rows, key=lambda r: -r[1])[:25]]
        own = [(f"{Path(f).name}:{line}({fn})", tt) for (f, line, fn), (_, _, tt, _, _) in stats.stats.items()]
        out["profile_own_s"] = [[name, round(tt, 4)] for name, tt in sorted(own, key=lambda r: -r[1])[:25]]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.hook_cost needs a CUDA device")
    rows = [measure(s, a.width, a.blocks, a.steps, False) for s in (None, packed.PACKED, torch.float8_e4m3fn)]
    rows += [dict(measure(s, a.width, a.blocks, a.steps, False, graphs=False), graphs=False)
             for s in (packed.PACKED, torch.float8_e4m3fn)]
    if a.profile:
        rows.append(dict(measure(packed.PACKED, a.width, a.blocks, a.steps, True), profiled=True))
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "width": a.width,
           "blocks": a.blocks, "tensors_per_block": TENSORS_PER_BLOCK, "rows": rows}
    text = json.dumps(doc, indent=1)
    if a.out:
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
