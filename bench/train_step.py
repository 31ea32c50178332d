"""Training-step throughput per model family, through the real Trainer (LoRA, flow matching).

    python bench/train_step.py                                  # every tiny family on the CPU
    python bench/train_step.py --family flux --variant FLUX.1-dev --device cuda --dtype bfloat16 \
        --height 1024 --width 1024 --offload                    # a released layout on a GPU

Samples are random tensors shaped like the family's cache entries (``spec.dummy_inputs``), so no
weights or data are needed.  Prints one JSON object: steps/s and s/step per family, after warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_core.models import get_family, known_families  # noqa: E402
from diffsynth_core.training.device import avoid_broken_kernels  # noqa: E402
from diffsynth_core.training.loop import Trainer  # noqa: E402
from stages.config import OffloadSection, TrainSection  # noqa: E402


def _samples(spec, model, args, count: int = 4) -> list[dict]:
    samples = []
    for seed in range(count):
        latents, cond = spec.dummy_inputs(model.config, batch=1, height=args.height, width=args.width,
                                          num_frames=args.frames, text_len=args.text_len, seed=seed)
        samples.append({"latents": latents[0], **{k: v[0] for k, v in cond.items()}})
    return samples


def bench_family(name: str, args) -> dict:
    spec = get_family(name)
    dtype = getattr(torch, args.dtype)
    device = avoid_broken_kernels(args.device)
    # Random weights are made fastest on the GPU; under offload they then move to host memory.
    model = spec.build_transformer(args.variant, dtype, args.device)
    if args.offload:
        model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    samples = _samples(spec, model, args)
    train = TrainSection(lora_rank=args.rank, max_steps=args.warmup + args.steps, save_steps=0, seed=0,
                         gradient_checkpointing=args.checkpointing, device=args.device)
    offload = OffloadSection(enable_model_cpu_offload=args.offload, prefetch=args.prefetch,
                             vram_budget_gb=args.vram_budget_gb)
    step_times: list[float] = []

    def clock(step: int, _model) -> None:  # called after each optimizer step
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(spec, model, samples, train, offload, out, device=device, progress=False,
                          callbacks=[clock])
        trainer.fit()
    timed = step_times[args.warmup:]
    seconds = (timed[-1] - step_times[args.warmup - 1]) / len(timed) if args.warmup else \
        (timed[-1] - timed[0]) / max(1, len(timed) - 1)
    return {"variant": args.variant, "device": args.device, "dtype": args.dtype, "offload": args.offload,
            "pixels": [args.height, args.width, args.frames], "lora_rank": args.rank,
            "params": sum(p.numel() for p in model.parameters()),
            "s_per_step": round(seconds, 5), "steps_per_s": round(1.0 / seconds, 3),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", action="append", help="repeatable; default: every family")
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--frames", type=int, default=1, help="video families only")
    parser.add_argument("--text-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--offload", action="store_true", help="stream the DiT with OffloadTrainingManager")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--vram-budget-gb", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    results = {}
    for name in args.family or known_families():
        frames = args.frames if get_family(name).frame_multiple > 1 else 1
        results[name] = bench_family(name, argparse.Namespace(**{**vars(args), "frames": frames}))
    print(json.dumps({"train_step": results, "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
