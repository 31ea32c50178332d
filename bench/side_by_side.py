"""Our engine and musubi-tuner's H2D-only ``LoRAStreamOffloader``, side by side, each in its own process.

    python -m bench.side_by_side --musubi-file .dev/custom_offloading_utils.py [--size quick] [--out F]

The same 24x3072 LoRA stack (``bench/dit_stack.py``: 4096 tokens, checkpointing, LoRA r32 on every
Linear, fused AdamW on the adapters) is trained in separate processes: all weights resident; our
engine with every block streamed (blocks as units; and split into Linears by
``cpu_offload_split_threshold``, which shrinks the slots); fp8 storage; a GPU budget that keeps 12
of the 24 blocks resident; the adapters' AdamW on the CPU (``streamed_hostopt``: the blocks own
their adapters, which stream with them, ``enable_optimizer_cpu_offload`` + ``bind_optimizer`` as the
trainer binds it; ``_early``: each block's step overlapped with backward, ``overlap_backward=True``;
the budget planner keeps no block with trainable weights resident, so there is no budget row of
it); rows ending in ``_act`` also keep the checkpointed block inputs in host memory
(``offload_activations``), rows ending in ``_hoststate`` also keep AdamW's moments there between
steps (``offload.optimizer_state_on_host``: the step stays on the GPU), rows ending in ``_bwdstep``
step each page of adapters during backward with its state paged in from the host
(``StepInBackward``, library use: no clipping or accumulation; ``--skip-nonfinite``: as the Trainer
runs it under ``offload.optimizer_step_in_backward``); and musubi's offloader
(``bench/musubi_harness.py``) with 24 and with 12 blocks swapped.  Prints one JSON document: s/step
(median), peak ``max_memory_allocated``, host->device bytes per step, and ratios to
``bound = max(resident s/step, bytes / pinned bandwidth)``.  Without ``--musubi-file`` the musubi
rows are skipped.  ``--interleave ROW[,ROW]`` also runs resident and each ROW alternately in one
process (``bench/interleaved.py``: ratios free of the drift between processes; ``static_12_of_24``:
12 blocks kept by ``resident_gb``, evenly spaced over all 24 as musubi places them; ``resident_act``:
resident with the block inputs offloaded; ``_p2``: three slots, ``prefetch=2``), ``--copies``
resident against resident with a block's bytes copied beside it.  ``--size tiny --device cpu`` checks the
script on a machine without a GPU (our rows only).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from bench.dit_stack import LORA_INPUTS, SIZES, build, pinned_bandwidth, stack_step, timed_steps

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 2**20, 2**30
# Our rows; "_act": the same with the checkpointed block inputs offloaded to host memory
# (``apply_gradient_checkpointing(..., offload_activations=True)``).
ROWS = ("streamed", "streamed_split", "fp8_streamed", "streamed_act", "fp8_streamed_act", "streamed_hostopt_act",
        "streamed_hostopt_early_act", "streamed_act_hoststate", "streamed_act_bwdstep", "budget_12_of_24",
        "budget_12_of_24_act", "budget_12_of_24_act_hoststate", "budget_12_of_24_act_bwdstep")
BUDGET = "budget_12_of_24"
STATIC = "static_12_of_24"  # interleaved only: offload.resident_gb (evenly spaced over all 24, as musubi places them)


def engine_options(mode: str, size: str, budget_gib: float | None) -> dict:
    """Our engine's options for each row."""
    linear = 4 * SIZES[size][1] ** 2 * 2  # the largest Linear of a block (up/down: 4·w²), bf16 bytes
    # "_hoststate", "_bwdstep", "_act", "_early": set in run_worker; "_pN" (interleaved only): N + 1 slots;
    # "_leaves" (interleaved only): every block split into its Linears (slots the size of the largest)
    leaves = mode.endswith("_leaves")
    mode = mode.removesuffix("_leaves")
    prefetch = re.search(r"_p(\d+)$", mode)
    mode = mode[:prefetch.start()] if prefetch else mode
    mode = mode.removesuffix("_hoststate").removesuffix("_bwdstep").removesuffix("_act")
    mode = mode.removesuffix("_early")
    host_optimizer = mode.endswith("_hostopt")
    opts = {"streamed": dict(prefetch=1),
            "streamed_split": dict(prefetch=2, cpu_offload_split_threshold=1.2 * linear / MIB),
            "fp8_streamed": dict(prefetch=1, storage_dtype=torch.float8_e4m3fn),
            BUDGET: dict(prefetch=1, vram_budget_gb=budget_gib),
            STATIC: dict(prefetch=1, resident_gb=budget_gib)}[mode.removesuffix("_hostopt")]
    opts = {**opts, "prefetch": int(prefetch.group(1))} if prefetch else opts
    opts = {**opts, "cpu_offload_split_threshold": linear / MIB} if leaves else opts
    return {**opts, "enable_optimizer_cpu_offload": True} if host_optimizer else opts


def run_worker(args) -> dict:
    """One row: train the stack with our engine (or resident) in this process."""
    from diffsynth_core.gradient import apply_gradient_checkpointing
    from diffsynth_core.offload import OffloadTrainingManager
    from diffsynth_core.training.device import avoid_broken_kernels

    device = avoid_broken_kernels(args.device)
    opts = engine_options(args.worker, args.size, args.budget_gib) if args.worker != "resident" else None
    host_optimizer = bool(opts and opts.get("enable_optimizer_cpu_offload"))
    model, x = build(args.size, device, lora_input=args.lora_input, adapters_in_blocks=host_optimizer)
    apply_gradient_checkpointing(model, ("blocks",), offload_activations="_act" in args.worker)
    mgr = None
    if opts is not None:
        mgr = OffloadTrainingManager(model, device, block_container_names=("blocks",), **opts)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # fused: torch's fused AdamW, on the GPU or (optimizer offload) the CPU, as build_optimizer picks it
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=device.type == "cuda" or host_optimizer)
    if host_optimizer:
        # as prepare.py binds it (steps queued by opt.step(), run off the main thread), or "_early": each
        # block's step starts once its gradients are on the host, during backward (library use only:
        # the trainer's non-finite guard must see every gradient first)
        mgr.bind_optimizer(opt, overlap_backward="_early" in args.worker)
    if args.worker.endswith("_hoststate"):  # AdamW's moments wait in host memory between steps
        from diffsynth_core.offload.optimizer_state import HostOptimizerState

        keeper = HostOptimizerState(opt, tuple(args.state_keys.split(",")) if args.state_keys else None)
        if args.state_sync:  # the copies out on the step's path, not beside the next forward
            opt.register_step_post_hook(lambda *_: keeper.wait())
    guarded = None  # --skip-nonfinite: the pager as offload.optimizer_step_in_backward runs it in the Trainer
    if args.worker.endswith("_bwdstep"):  # each page of adapters steps during backward, state paged in
        from diffsynth_core.offload.backward_steps import StepInBackward

        pager = StepInBackward(opt, skip_nonfinite=args.skip_nonfinite)
        guarded = pager if args.skip_nonfinite else None

    out = timed_steps(stack_step(model, x, opt, mgr, guarded), device, args.steps, args.warmup)
    if mgr is not None:
        rep = mgr.report()
        out.update(h2d_gb_per_step=rep["last_step_h2d_bytes"] / 1e9, units=rep["units"],
                   resident_units=rep["budget_units"], compact_units=rep["compact_units"], stalls=rep["stalls"],
                   pinned=rep["pinned"],
                   planned_h2d_gb_per_step=(rep["planned_h2d_bytes_per_step"] or 0) / 1e9 or None,
                   budget_gib=(rep["budget_bytes"] or 0) / GIB or None,
                   unit_gib=max(u.dev_bytes for u in mgr.plan.units) / GIB)
        if rep.get("host_optimizer"):
            out["host_optimizer"] = rep["host_optimizer"]
        mgr.detach()
    else:
        out["h2d_gb_per_step"] = 0.0
    return out


def _spawn(cmd: list[str]) -> dict:
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Rows(dict):
    """The rows so far, written to ``out`` after each one (a run cut short keeps what it measured)."""

    def __init__(self, out: str | None):
        super().__init__()
        self.out = out

    def __setitem__(self, name, row) -> None:
        super().__setitem__(name, row)
        if self.out:
            Path(self.out).write_text(json.dumps({"partial": True, "rows": self}, indent=1))


def orchestrate(args) -> dict:
    device = torch.device(args.device)
    common = ["--size", args.size, "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--lora-input", args.lora_input]
    ours = [*common, "--state-keys", args.state_keys] + (["--state-sync"] if args.state_sync else []) + \
        (["--skip-nonfinite"] if args.skip_nonfinite else [])
    rows = Rows(args.out)
    rows["resident"] = _spawn(["-m", "bench.side_by_side", "--worker", "resident", *ours])
    # A budget row plans from the matching all-streamed row's peak: asking for it runs that row too.
    budgets = [mode for mode in ROWS if mode.startswith(BUDGET) and mode in args.rows]
    # interleaved budget rows plan from the same all-streamed row; --copies copies its block's bytes
    args.rows = [*args.rows, *map(all_streamed, args.interleave),
                 *(["streamed_act"] if args.copies else [])]
    wanted = set(args.rows) | set(map(all_streamed, budgets))
    for mode in ROWS:
        if mode in wanted and not mode.startswith(BUDGET):
            rows[mode] = _spawn(["-m", "bench.side_by_side", "--worker", mode, *ours])
    for mode in budgets:
        streamed = rows.get(all_streamed(mode), {})
        if not streamed.get("peak_gib"):
            rows[mode] = {"error": f"{all_streamed(mode)} gave no peak to plan from"}
        else:
            rows[mode] = _spawn(["-m", "bench.side_by_side", "--worker", mode, *ours,
                                 "--budget-gib", f"{budget_gib(streamed):.4f}"])
    for mode in args.interleave:  # resident and one of our rows alternately in one process (bench/interleaved.py)
        streamed = rows.get(all_streamed(mode), {})
        budget = []
        if mode.startswith(BUDGET):
            budget = ["--budget-gib", f"{budget_gib(streamed):.4f}"] if streamed.get("peak_gib") else None
        elif mode.startswith(STATIC):  # 12 of the 24 blocks, evenly spaced, without measuring
            budget = ["--budget-gib", f"{12.5 * streamed['unit_gib']:.4f}"] if streamed.get("unit_gib") else None
        rows[f"interleaved_{mode}"] = {"error": "no all-streamed row to plan from"} if budget is None else \
            _spawn(["-m", "bench.interleaved", "--mode", mode, "--pairs", str(args.pairs), *common, *budget])
    if args.copies and rows.get("streamed_act", {}).get("unit_gib"):  # a block's bytes, moved by no engine
        rows["interleaved_resident_copies"] = _spawn(["-m", "bench.interleaved", "--mode", "resident_copies",
                                                      "--copy-gib", str(rows["streamed_act"]["unit_gib"]),
                                                      "--pairs", str(args.pairs), *common])
    if args.musubi_file and device.type == "cuda":
        for swap in (SIZES[args.size][0], SIZES[args.size][0] // 2):
            rows[f"musubi_swap_{swap}"] = _spawn(["-m", "bench.musubi_harness", "--musubi-file", args.musubi_file,
                                                  "--blocks-to-swap", str(swap), *common])
    bandwidth = pinned_bandwidth(device)
    summarise(rows, bandwidth)
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "size": dict(zip(("blocks", "width", "tokens"), SIZES[args.size])), "h2d_pinned_gb_s": bandwidth,
            "rows": dict(rows)}


def all_streamed(mode: str) -> str:
    """The all-streamed row a budget or static row plans from (``budget_12_of_24_act_p2``:
    ``streamed_act``); another row is its own."""
    return mode.removesuffix("_p2").replace(BUDGET, "streamed").replace(STATIC, "streamed")


def budget_gib(streamed: dict) -> float:
    """The budget of the ``budget_12_of_24`` rows: room for 12.5 blocks above what the matching
    all-streamed step peaks at, plus the planner's margin, so that it keeps 12 of the 24 resident."""
    room = streamed["peak_gib"] + 12.5 * streamed["unit_gib"] + 256 * MIB / GIB
    return room / 0.98


def summarise(rows: dict, bandwidth: float | None) -> None:
    resident = rows["resident"].get("step_s")
    for name, row in rows.items():
        if name == "resident" or "step_s" not in row or not resident or name.startswith("interleaved_"):
            continue
        bound = max(resident, row["h2d_gb_per_step"] / bandwidth) if bandwidth else resident
        row.update(bound_s=bound, step_over_bound=row["step_s"] / bound, step_over_resident=row["step_s"] / resident)
        row.pop("step_s_all", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora-input", choices=LORA_INPUTS, default="narrow",
                    help="adapters save their bf16 input (splitflow's LoRA) or an fp32 copy (a plain x.float())")
    ap.add_argument("--state-keys", default="", help="_hoststate rows: only these optimizer state keys "
                    "(comma-separated, e.g. exp_avg_sq); all when empty")
    ap.add_argument("--state-sync", action="store_true", help="_hoststate rows: wait for the state's copies out "
                    "at the end of each step")
    ap.add_argument("--skip-nonfinite", action="store_true", help="_bwdstep rows: each page skips its step on the "
                    "device over NaN/Inf, the count read once a step (offload.optimizer_step_in_backward)")
    ap.add_argument("--musubi-file", default=None, help="musubi-tuner's custom_offloading_utils.py (not shipped)")
    ap.add_argument("--rows", default=",".join(ROWS), type=lambda v: v.split(","),
                    help="which of our rows to run (resident always runs)")
    interleavable = [m for m in ROWS if "_host" not in m and "_bwdstep" not in m] + [STATIC, f"{STATIC}_act"]
    interleavable = [*interleavable, *(f"{m}_p2" for m in interleavable if m != "resident_act"), "resident_act"]
    ap.add_argument("--interleave", default=[], type=lambda v: v.split(","),
                    help=f"also run resident and each of these rows alternately in one process (ratios free of "
                         f"the drift between processes; a row's own prerequisites run first): {interleavable}")
    ap.add_argument("--pairs", type=int, default=6, help="--interleave: resident/row pairs")
    ap.add_argument("--copies", action="store_true", help="--interleave: also resident against resident with a "
                    "block's bytes copied to the GPU beside every other block (what the copies alone cost)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget-gib", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if set(args.interleave) - set(interleavable):
        ap.error(f"--interleave takes {interleavable}, got {args.interleave}")
    if args.worker:
        print(json.dumps(run_worker(args)))
        return
    text = json.dumps(orchestrate(args), indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
