"""Training-step throughput per model family and batch size, through the real Trainer (LoRA, flow matching).

    python bench/train_step.py                                  # every tiny family on the CPU, batch 1
    python bench/train_step.py --family flux --variant FLUX.1-dev --device cuda --dtype bfloat16 \
        --sizes 512,1024 --batch-size 1,2,4 --modes resident,offload --text-len 512

For each mode (``resident``: the DiT on the device; ``offload``: streamed from host memory by the offload
engine) the model is built and prepared once; then every size x batch size runs ``--warmup`` optimizer
steps and ``--steps`` timed ones on the same prepared model, so batch sizes are compared side by side in
one process.  ``--spec-variant t2v-a14b`` (a family variant with experts, e.g. Wan2.2 A14B) builds one DiT
per expert and trains both in one run, each step routing its samples by sigma (training/experts.py).
Samples are random tensors shaped like the family's cache entries (``spec.dummy_inputs``),
so no weights or data are needed.  Prints one JSON object: s/step, s/sample and samples/s per run, and
each batch size's samples/s relative to batch 1 (``speedup``).  ``--budget-s`` skips a mode, or a size
after a mode's first, that would start after that many seconds (marked ``"skipped"``); ``--out FILE``
rewrites the JSON after every size.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_core.models import get_family, known_families  # noqa: E402
from diffsynth_core.training.device import avoid_broken_kernels  # noqa: E402
from diffsynth_core.training.experts import ExpertModels  # noqa: E402
from diffsynth_core.training.loop import Trainer  # noqa: E402
from diffsynth_core.training.prepare import prepare_for_training  # noqa: E402
from stages.config import OffloadSection, TrainSection  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _sizes(text: str) -> list[str]:
    """Image sizes: ``1024`` (square) or ``480x832`` (height x width), comma-separated."""
    return [part for part in text.split(",") if part]


def _height_width(size: str) -> tuple[int, int]:
    height, _, width = size.partition("x")
    return int(height), int(width or height)


def _samples(spec, model, args, size: str, count: int) -> list[dict]:
    samples, (height, width) = [], _height_width(size)
    # edit variants: reference latents of the target's size, each as long a sequence as the target
    references = {} if args.references is None else {"references": args.references}
    for seed in range(count):
        config = model.expert_model(model.experts[0]).config if isinstance(model, ExpertModels) else model.config
        latents, cond = spec.dummy_inputs(config, batch=1, height=height, width=width,
                                          num_frames=args.frames, text_len=args.text_len, seed=seed, **references)
        samples.append({"latents": latents[0], **{k: v[0] for k, v in cond.items()}})
    return samples


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(trainer: Trainer, prepared, batch_size: int, args, device: torch.device) -> dict:
    sampler = trainer.make_sampler(batch_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        trainer.optimizer_step(prepared, sampler)
    _sync(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        trainer.optimizer_step(prepared, sampler)
    _sync(device)
    per_step = (time.perf_counter() - started) / args.steps
    return {"s_per_step": round(per_step, 5), "s_per_sample": round(per_step / batch_size, 5),
            "samples_per_s": round(batch_size / per_step, 3),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None}


def _build(spec, args, device: torch.device) -> torch.nn.Module:
    """Random weights are made fastest on the device.  Under offload the engine then copies them into its
    pinned host arena one tensor at a time, freeing each device copy: the same state as weights loaded
    on the host, reached without a detour through pageable memory."""
    if spec.experts:  # one DiT per expert, each with its own random weights
        return ExpertModels(spec.experts, {e.component: spec.build_transformer(args.variant, getattr(torch, args.dtype),
                                                                               str(device)) for e in spec.experts})
    return spec.build_transformer(args.variant, getattr(torch, args.dtype), str(device))


def _record_routing(model) -> list[str] | None:
    """For several experts, a list that gets the experts each optimizer step trained, in step order."""
    if not isinstance(model, ExpertModels):
        return None
    routed, take_ran = [], model.take_ran

    def recorded() -> set[str]:
        ran = take_ran()
        routed.append("+".join(sorted(ran)))
        return ran
    model.take_ran = recorded
    return routed


def _bench_size(trainer: Trainer, prepared, mode: str, size: str, args, device: torch.device) -> list[dict]:
    """Every batch size at one image size.  The largest batch first runs ``--warmup`` untimed steps, so
    first-use costs of the new shapes (allocator growth, kernel choice) land on no timed batch size."""
    sampler = trainer.make_sampler(max(args.batch_size))
    for _ in range(args.warmup):
        trainer.optimizer_step(prepared, sampler)
    runs = []
    for batch_size in args.batch_size:
        runs.append({"mode": mode, "size": size, "batch_size": batch_size,
                     **_time_steps(trainer, prepared, batch_size, args, device)})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return runs


def bench_mode(spec, args, mode: str, device: torch.device, over_budget, record) -> list[dict]:
    """Build and prepare the model once for ``mode``, then time every size x batch size on it.

    ``over_budget`` is asked before building (set-up under offload pins the whole DiT: ~30 s for FLUX on
    the H200) and before each size after the first: a prepared model always gets its first size timed.
    """
    skipped = lambda sizes: [{"mode": mode, "size": size, "batch_size": b, "skipped": True}  # noqa: E731
                             for size in sizes for b in args.batch_size]
    if over_budget():
        return skipped(args.sizes)
    started = time.perf_counter()
    model = _build(spec, args, device)
    act_offload = {"auto": "auto", "true": True, "false": False}[args.act_offload]
    train = TrainSection(lora_rank=args.rank, seed=0, gradient_checkpointing=args.checkpointing, device=str(device),
                         gradient_checkpointing_offload=act_offload)
    options = OffloadSection(enable_model_cpu_offload=mode == "offload", prefetch=args.prefetch,
                             vram_budget_gb=args.vram_budget_gb)
    dit_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # The largest sample's latents, as the Trainer passes them: "auto" activation offload reads them (a budget
    # too small for the checkpointed block inputs keeps them in host memory).
    largest = max((_samples(spec, model, args, size, count=1)[0]["latents"].shape for size in args.sizes),
                  key=lambda shape: shape.numel())
    prepared = prepare_for_training(model, spec, train, options, device, tuple(largest))
    routed = _record_routing(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the device copies the offload engine freed
    print(json.dumps({"mode": mode, "setup_s": round(time.perf_counter() - started, 1)}), file=sys.stderr, flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as out:
        for i, size in enumerate(args.sizes):
            if i and over_budget():
                runs += skipped(args.sizes[i:])
                break
            samples = _samples(spec, model, args, size, count=2 * max(args.batch_size))
            trainer = Trainer(spec, model, samples, train, options, out, device=device, progress=False)
            runs += _bench_size(trainer, prepared, mode, size, args, device)
            if routed is not None:  # which expert each step (warm-up ones first) trained: the peak's and time's mix
                runs[-1]["experts_per_step"], routed[:] = list(routed), []
            # The process's host peak so far (run offload first to read its own) against the DiT's bytes.
            host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            runs[-1].update(host_peak_gb=round(host / 1e9, 2), dit_gb=round(dit_bytes / 1e9, 2),
                            host_over_dit=round(host / dit_bytes, 3))
            record(runs)
    if prepared.offload is not None:
        prepared.offload.detach(restore_frozen=False)  # nothing reads the base afterwards
    del prepared, model
    gc.collect()
    return runs


def _speedups(runs: list[dict]) -> dict:
    """samples/s of each batch size over batch 1's, per mode and size."""
    out = {}
    for run in runs:
        base = next((r for r in runs if r["mode"] == run["mode"] and r["size"] == run["size"]
                     and r["batch_size"] == 1 and "samples_per_s" in r), None)
        if base is not None and "samples_per_s" in run:
            key = f"{run['mode']}@{run['size']}"
            out.setdefault(key, {})[str(run["batch_size"])] = round(run["samples_per_s"] / base["samples_per_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", action="append", help="repeatable; default: every family")
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--spec-variant", help="the family's variant (e.g. wan t2v-a14b: both experts in one run)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sizes", type=_sizes, default=["128"],
                        help="image sizes in pixels: square (512,1024) or HxW (480x832)")
    parser.add_argument("--references", type=int, default=None,
                        help="edit variants: reference latents per sample, each of the target's size")
    parser.add_argument("--batch-size", type=_ints, default=[1], help="batch sizes compared in one run, e.g. 1,2,4")
    parser.add_argument("--modes", default="resident", help="resident,offload")
    parser.add_argument("--frames", type=int, default=1, help="video families only")
    parser.add_argument("--text-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--act-offload", choices=("auto", "true", "false"), default="auto",
                        help="train.gradient_checkpointing_offload: the checkpointed block inputs in host memory")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--vram-budget-gb", type=float, default=0.0)
    parser.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--out", help="also write the JSON here (rewritten after every run)")
    args = parser.parse_args()
    started = time.perf_counter()
    clock = lambda: time.perf_counter() - started  # noqa: E731
    over_budget = lambda: args.budget_s is not None and clock() > args.budget_s  # noqa: E731
    device = avoid_broken_kernels(args.device)
    report = {"train_step": {}, "threads": torch.get_num_threads(), "args": vars(args)}
    for name in args.family or known_families():
        spec = get_family(name, args.spec_variant)
        frames = args.frames if spec.frame_multiple > 1 else 1
        family_args = argparse.Namespace(**{**vars(args), "frames": frames})
        done: list[dict] = []

        def record(runs: list[dict]) -> None:
            every = done + runs
            report["train_step"][name] = {"variant": args.variant, "runs": every, "speedup": _speedups(every)}
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=2))

        for mode in args.modes.split(","):
            done += bench_mode(spec, family_args, mode, device, over_budget, record)
            record([])
    report["seconds"] = round(clock(), 1)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
