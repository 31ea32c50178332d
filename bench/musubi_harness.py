"""musubi-tuner's H2D-only ``LoRAStreamOffloader`` driving ``bench/dit_stack.py``, as its trainers do.

    python -m bench.musubi_harness --musubi-file PATH --blocks-to-swap N [--size full]

The offloader class is imported from musubi-tuner's own ``src/musubi_tuner/modules/
custom_offloading_utils.py`` (path given on the command line; the file is not part of this
repository).  Wiring follows ``src/musubi_tuner/qwen_image/qwen_image_model.py`` and
``training/trainer_base.py``: ``create_offloader`` with ``h2d_only`` and pinned masters (ring of
2), ``prepare_block_devices_before_forward`` once before training, and in the forward
``wait_for_block(i)`` / ``checkpoint(block, ...)`` / ``submit_move_blocks_forward(blocks, i)``; its
own backward hooks do the rest.  Bytes per step are counted by wrapping the copier's ``submit``.
Prints one JSON line like ``bench/side_by_side.py``'s workers.

``--pairs N``: musubi's offloader cannot be detached, so a second model of the same seed stays
resident on the GPU beside it, checkpointed the same way, and the two alternate (ABBA) in this
process as ``bench/interleaved.py``'s sides do; the JSON then has its pairs and ratios in that
script's form (``engine`` is musubi's).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys

import torch
from torch.utils.checkpoint import checkpoint

from bench.dit_stack import LORA_INPUTS, build, timed_steps


def load_offloading(path: str):
    spec = importlib.util.spec_from_file_location("musubi_custom_offloading_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--musubi-file", required=True)
    ap.add_argument("--blocks-to-swap", type=int, required=True)
    ap.add_argument("--size", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora-input", choices=LORA_INPUTS, default="narrow")
    ap.add_argument("--pairs", type=int, default=0, help="alternate with a resident copy of the model")
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # as in our rows (avoid_broken_kernels)
    print("building", file=sys.stderr, flush=True)
    musubi = load_offloading(args.musubi_file)
    device = torch.device(args.device)
    model, x = build(args.size, device, lora_input=args.lora_input)
    blocks = list(model.blocks)
    config = musubi.BlockSwapConfig(device=device, supports_backward=True, use_pinned_memory=True, h2d_only=True,
                                    ring_size=2)
    offloader = musubi.create_offloader("stack-block", blocks, len(blocks), args.blocks_to_swap, config)
    copied = [0]
    submit = offloader.copier.submit

    def counting_submit(key, dst_flat, src_flat, gate_event=None):
        copied[0] += src_flat.numel()
        return submit(key, dst_flat, src_flat, gate_event)
    offloader.copier.submit = counting_submit
    offloader.prepare_block_devices_before_forward(blocks)
    torch.cuda.empty_cache()

    def forward(h):
        for i, blk in enumerate(blocks):
            offloader.wait_for_block(i)
            h = checkpoint(blk, h, use_reentrant=False)
            offloader.submit_move_blocks_forward(blocks, i)
        return h

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    before = [0]

    def step():
        before[0] = copied[0]
        loss = forward(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if args.pairs:
        print(json.dumps(interleaved(step, resident_step(args, device), device, args)))
        return
    out = timed_steps(step, device, args.steps, args.warmup)
    out.update(h2d_gb_per_step=(copied[0] - before[0]) / 1e9, streamed_blocks=offloader.S,
               stream_idx=offloader.stream_idx)
    print(json.dumps(out))


def resident_step(args, device):
    """One training step of a resident model of the same seed, its blocks checkpointed as above."""
    model, x = build(args.size, device, lora_input=args.lora_input)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    def step():
        h = x
        for blk in model.blocks:
            h = checkpoint(blk, h, use_reentrant=False)
        loss = h.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def interleaved(musubi_step, resident, device, args) -> dict:
    """ABBA pairs of timed segments (peaks are both models' together, so left out)."""
    pairs, every = [], {"resident": [], "engine": []}
    for i in range(args.pairs):
        order = ("resident", "engine") if i % 2 == 0 else ("engine", "resident")
        runs = {}
        for side in order:
            runs[side] = timed_steps(resident if side == "resident" else musubi_step, device, args.steps, args.warmup)
            every[side] += runs[side]["step_s_all"][args.warmup:]
        pairs.append({"resident": runs["resident"]["step_s"], "engine": runs["engine"]["step_s"],
                      "ratio": runs["engine"]["step_s"] / runs["resident"]["step_s"]})
        print(f"pair {i}: {pairs[-1]}", file=sys.stderr, flush=True)
    pooled = {side: statistics.median(times) for side, times in every.items()}
    return {"mode": f"musubi_swap_{args.blocks_to_swap}", "pairs": pairs,
            "median_pair_ratio": statistics.median(p["ratio"] for p in pairs),
            "pooled_ratio": pooled["engine"] / pooled["resident"], "pooled_step_s": pooled}


if __name__ == "__main__":
    main()
