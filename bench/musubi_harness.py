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
process (``bench.interleaved.alternate``); the JSON then has its pairs and ratios in that
script's form (``engine`` is musubi's; no peaks: they would be both models' together).

``--ours MODE --budget-gib G --pairs N``: three sides in one process, N rounds (``bench.interleaved.rotate``,
every order of the three in turn): resident and our row MODE on one model (attached and detached
each round, as ``bench.interleaved`` does) and musubi's offloader on the other, so that the two
engines are compared with each other on the same machine at the same moment, not only each with
resident.  Our planner measures the device's peak, which now holds the other model too: its budget
is G plus that model's bytes (measured), and each side's ``own_peak_gib`` is its peak less the
other model's bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from bench.dit_stack import LORA_INPUTS, SIZES, build, stack_step, timed_steps
from bench.interleaved import alternate, engine_mode, rotate, segment
from bench.side_by_side import engine_options

GIB = 2**30


def load_offloading(path: str):
    spec = importlib.util.spec_from_file_location("musubi_custom_offloading_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--musubi-file", required=True)
    ap.add_argument("--blocks-to-swap", type=int, required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora-input", choices=LORA_INPUTS, default="narrow")
    ap.add_argument("--pairs", type=int, default=0, help="alternate with a resident copy of the model "
                    "(with --ours: rounds of the three sides)")
    ap.add_argument("--ours", default=None, help="one of bench.interleaved's modes: three sides, see above")
    ap.add_argument("--budget-gib", type=float, default=None, help="--ours: our row's budget")
    args = ap.parse_args()
    if not Path(args.musubi_file).is_file():
        ap.error(f"--musubi-file {args.musubi_file}: no such file (musubi-tuner's "
                 "src/musubi_tuner/modules/custom_offloading_utils.py)")
    depth = SIZES[args.size][0]
    if not 0 <= args.blocks_to_swap <= depth:
        ap.error(f"--blocks-to-swap {args.blocks_to_swap}: the {args.size} stack has {depth} blocks")
    if args.ours:
        if args.budget_gib is None or args.pairs < 1:
            ap.error("--ours needs --budget-gib (our row's budget, as alone) and --pairs (rounds, best a multiple of 6)")
        try:  # an unknown row fails here, not after both models are built
            engine_options(engine_mode(args.ours), args.size, args.budget_gib)
        except KeyError:
            ap.error(f"--ours {args.ours}: not one of our rows (bench/interleaved.py --help lists them)")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: musubi-tuner's offloader copies on CUDA streams")
    torch.backends.cuda.enable_cudnn_sdp(False)  # as in our rows (avoid_broken_kernels)
    print("building", file=sys.stderr, flush=True)
    musubi = load_offloading(args.musubi_file)
    device = torch.device(args.device)
    if args.ours:
        print(json.dumps(three_way(args, musubi, device)))
        return
    model, x = build(args.size, device, lora_input=args.lora_input)
    step, copied, offloader = musubi_training(musubi, model, x, args.blocks_to_swap, device)

    if args.pairs:
        resident, resident_x = build(args.size, device, lora_input=args.lora_input)
        resident_train = training_step(lambda h: checkpointed(resident.blocks, h), resident_x, resident)

        def run(side):
            out = timed_steps(resident_train if side == "resident" else step, device, args.steps, args.warmup)
            return {"step_s": out["step_s"], "step_s_all": out["step_s_all"]}  # peaks: both models' together
        print(json.dumps({"mode": f"musubi_swap_{args.blocks_to_swap}",
                          **alternate(run, "engine", args.pairs, args.warmup)}))
        return
    out = timed_steps(step, device, args.steps, args.warmup)
    out.update(h2d_gb_per_step=copied["last_step"] / 1e9, streamed_blocks=offloader.S,
               stream_idx=offloader.stream_idx)
    print(json.dumps(out))


def musubi_training(musubi, model, x, blocks_to_swap: int, device):
    """musubi's offloader on ``model`` (wired as its trainers wire it) and one training step of it;
    the step, the bytes its copier moved (``copied["last_step"]``: in the latest step) and the offloader."""
    blocks = list(model.blocks)
    config = musubi.BlockSwapConfig(device=device, supports_backward=True, use_pinned_memory=True, h2d_only=True,
                                    ring_size=2)
    offloader = musubi.create_offloader("stack-block", blocks, len(blocks), blocks_to_swap, config)
    copied = {"last_step": 0}
    submit = offloader.copier.submit

    def counting_submit(key, dst_flat, src_flat, gate_event=None):
        copied["last_step"] += src_flat.numel()
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

    train = training_step(forward, x, model)

    def step():
        copied["last_step"] = 0
        return train()
    return step, copied, offloader


def three_way(args, musubi, device) -> dict:
    """``--ours``: resident, musubi's offloader and our row, rotated in this process (see above)."""
    ours_model, ours_x = build(args.size, device, lora_input=args.lora_input)
    opt = torch.optim.AdamW([p for p in ours_model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    stack_step(ours_model, ours_x, opt)()  # AdamW's state exists before the other model is measured
    torch.cuda.synchronize(device)
    ours_bytes = torch.cuda.memory_allocated(device)  # the resident model, its state and input
    model, x = build(args.size, device, lora_input=args.lora_input)
    musubi_step, copied, _ = musubi_training(musubi, model, x, args.blocks_to_swap, device)
    musubi_step()
    torch.cuda.synchronize(device)
    musubi_bytes = torch.cuda.memory_allocated(device) - ours_bytes
    # our planner caps the device's peak, which holds musubi's model too; its margin grows by a
    # 50th of the budget (budget.margin_bytes): B * 50 / 49 more budget leaves exactly B more room
    args.budget_gib = args.budget_gib + musubi_bytes / GIB * 50 / 49
    args.sampler, args.copy_gib = None, 0.0  # as bench.interleaved's main sets them

    def run(side: str) -> dict:
        if side == "musubi":
            out = timed_steps(musubi_step, device, args.steps, args.warmup)
            out.pop("losses")
            out.update(own_peak_gib=out["peak_gib"] - ours_bytes / GIB, h2d_gb_per_step=copied["last_step"] / 1e9)
            return out
        out = segment(ours_model, ours_x, opt, device, side if side == "resident" else args.ours, args)
        out["own_peak_gib"] = out["peak_gib"] - musubi_bytes / GIB
        return out
    return {"mode": f"three_way_{args.ours}_musubi_swap_{args.blocks_to_swap}", "budget_gib": args.budget_gib,
            "other_model_gib": {"musubi": musubi_bytes / GIB, "ours": ours_bytes / GIB},
            **rotate(run, ("resident", "musubi", "ours"), args.pairs, args.warmup)}


def checkpointed(blocks, h):
    """The resident model's forward: each block checkpointed as in musubi's wiring above."""
    for blk in blocks:
        h = checkpoint(blk, h, use_reentrant=False)
    return h


def training_step(forward, x, model):
    """One step: ``forward(x)``'s squared mean, backward, fused AdamW over the LoRA weights."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

    def step():
        loss = forward(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step

if __name__ == "__main__":
    main()
