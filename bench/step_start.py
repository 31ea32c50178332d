"""Where the host spends a training step's edges: from one step's end to the next step's first block.

    python -m bench.step_start [--layers 4] [--steps 8] [--pixels 1024] [--device cuda] [--cache zarr|memory]
                               [--old-loop]

The GPU waits at each step's start while the host draws noise, reads and collates the batch and runs
the DiT's prologue (embeddings, rotary tables) before the first block: that time is idle GPU in
every mode, resident or offloaded.  This trains Qwen-Image's released width (``--layers`` blocks,
all resident, LoRA r32, checkpointing) through the real ``Trainer`` and stamps host phases with
wrappers around the trainer's own methods.  No synchronisation is added inside the step; the step
ends with one ``torch.cuda.synchronize``, as the benchmarks' clocks do.  ``drawn`` and ``stacked``
end the last sample draw and stack of the next round, which the trainer prepares before it waits
for this round's loss (``training/prefetch.py``).  ``--cache zarr`` reads the samples from a real
zarr cache on local disk, as ``splitflow train`` does; ``--old-loop`` runs the loop as it was before
(each batch prepared when its round starts, the model's dtype read at every step).  Prints JSON: per phase (between two stamps
in time order) the median host milliseconds over the steps after the first two.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _samples(spec, config, pixels: int, cache: str, workdir: str):
    samples = []
    for seed in range(4):
        latents, cond = spec.dummy_inputs(config, batch=1, height=pixels, width=pixels, text_len=128, seed=seed)
        samples.append({"latents": latents[0], **{k: v[0] for k, v in cond.items()}})
    if cache == "memory":
        return samples
    from cache_store import open_cache
    from stages.train import CachedSamples

    url = f"{workdir}/cache.zarr"
    store = open_cache(url, "a", backend="zarr", fingerprint="bench", family="qwen_image", writer="bench")
    for i, entry in enumerate(samples):
        store.put(f"k{i}", entry)
    store.commit()
    return CachedSamples(open_cache(url, "r"), [f"k{i}" for i in range(len(samples))])


def use_old_loop(trainer) -> None:
    """Make ``trainer`` run the loop as it was before ``training/prefetch.py``, for side-by-side
    figures: each batch prepared when its round starts, the model's dtype read at every step."""
    trainer.next_batch.prepare_ahead = lambda batch: None
    trainer._input_dtype = lambda model: getattr(model, "dtype", torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pixels", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cache", choices=("memory", "zarr"), default="memory")
    ap.add_argument("--old-loop", action="store_true", help="the loop as it was, for a side-by-side figure: "
                    "each batch prepared when its round starts, the model's dtype read at every step")
    a = ap.parse_args()

    from diffsynth_core.models import get_family, qwen_image
    from diffsynth_core.models.random_models import build_random_transformer
    from diffsynth_core.training import guards, loop
    from diffsynth_core.training.device import avoid_broken_kernels
    from stages.config import OffloadSection, TrainSection

    device = avoid_broken_kernels(a.device)
    cuda = device.type == "cuda"
    spec = get_family("qwen_image")
    real = qwen_image.TRANSFORMER_CONFIGS["Qwen-Image" if cuda else "tiny"]
    model = build_random_transformer(qwen_image.TRANSFORMER_CLASS, {"w": {**real, "num_layers": a.layers}}, "w",
                                     torch.bfloat16, device)
    workdir = tempfile.mkdtemp()
    samples = _samples(spec, model.config, a.pixels if cuda else 64, a.cache, workdir)

    stamps: list[dict[str, float]] = []

    def stamp(name: str) -> None:
        if stamps:
            stamps[-1].setdefault(name, time.perf_counter())

    def stamped(original, before: str | None, after: str | None):
        def wrapped(*args, **kwargs):
            if before:
                stamp(before)
            out = original(*args, **kwargs)
            if after and stamps:
                stamps[-1][after] = time.perf_counter()  # the last call's end
            return out
        return wrapped

    def wrap(owner, name: str, before: str | None, after: str | None):
        setattr(owner, name, stamped(getattr(owner, name), before, after))

    original_step = loop.Trainer.optimizer_step

    def optimizer_step(self, *args, **kwargs):
        stamps.append({"begin": time.perf_counter()})
        return original_step(self, *args, **kwargs)
    loop.Trainer.optimizer_step = optimizer_step
    wrap(loop.Trainer, "_draw", None, "drawn")
    wrap(loop, "stack_entries", None, "stacked")
    spec = dataclasses.replace(spec, dit_forward=stamped(spec.dit_forward, "forward_called", "forward_returned"))
    wrap(torch.Tensor, "backward", None, "backward_returned")
    wrap(loop, "grad_norm", "loss_read", "norm_launched")
    wrap(guards.NonFiniteGuard, "allows_update", None, "guard_decided")
    first_block = model.transformer_blocks[0]
    first_block.register_forward_pre_hook(lambda *_: stamp("first_block") if torch.is_grad_enabled() else None)

    def clock(step, _model):
        if cuda:
            torch.cuda.synchronize()
        stamps[-1]["end"] = time.perf_counter()

    train = TrainSection(lora_rank=32, max_steps=a.steps, seed=0, gradient_checkpointing=True, device=a.device)
    trainer = loop.Trainer(spec, model, samples, train, OffloadSection(), tempfile.mkdtemp(), device=device,
                           progress=False, callbacks=[clock])
    if a.old_loop:
        use_old_loop(trainer)
    trainer.fit()

    phases: dict[str, list[float]] = {}
    for i, s in enumerate(stamps[2:], start=2):
        previous_end = stamps[i - 1]["end"]
        # In time order: the next batch's reads ("drawn", "stacked") come after this step's backward
        # when the trainer prepares it ahead, before this step's first block when it does not.
        marks = sorted([("previous_end", previous_end)] + list(s.items()), key=lambda mark: mark[1])
        for (a_name, a_t), (b_name, b_t) in zip(marks, marks[1:]):
            phases.setdefault(f"{a_name}->{b_name}", []).append((b_t - a_t) * 1e3)
        phases.setdefault("step", []).append((s["end"] - previous_end) * 1e3)
        phases.setdefault("previous_end->first_block", []).append((s["first_block"] - previous_end) * 1e3)
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "layers": a.layers,
                      "pixels": a.pixels, "cache": a.cache,
                      "loop": "old" if a.old_loop else "new",
                      "median_ms": {k: round(statistics.median(v), 3) for k, v in phases.items()}}, indent=1))


if __name__ == "__main__":
    main()
