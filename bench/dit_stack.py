"""The DiT-like LoRA stack both sides of ``bench/side_by_side.py`` train, and how they are timed.

24 single-stream blocks of width 3072 (pre-norm attention with 24 heads + a 4x MLP: 12·w² weights,
226 MB in bf16 each), 4096 tokens, gradient checkpointing per block, a rank-32 LoRA on every
Linear.  The LoRA is a forward replacement (as musubi-tuner's ``networks/lora.py`` does): the
adapters live outside the blocks, in fp32, and the block's own ``nn.Linear`` keeps its weight, so
any block-swapping scheme (ours, or musubi's, which streams exactly the blocks' ``*Linear``
weights) sees the same modules and both compute bitwise the same thing.  The adapters project
their input as splitflow's LoRA does with ``train.lora_narrow_inputs`` (``lora_input="narrow"``,
the default here: the bf16 input is saved and cast to fp32 inside,
``diffsynth_core/training/adapter_inputs.py``) or as a plain ``x.float()`` would (``"fp32"``:
autograd saves the fp32 copy); the results are bitwise equal, the saved bytes not.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from diffsynth_core.training.adapter_inputs import project_down

LORA_INPUTS = ("narrow", "fp32")


class Block(nn.Module):
    """Single-stream DiT block: pre-norm attention + MLP (12·w² parameters)."""

    def __init__(self, w: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(w, 3 * w), nn.Linear(w, w)
        self.up, self.down = nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

    def forward(self, x):
        b, n, w = x.shape
        q, k, v = self.qkv(F.layer_norm(x, (w,))).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, w)
        x = x + self.out(a)
        return x + self.down(F.gelu(self.up(F.layer_norm(x, (w,))), approximate="tanh"))


def hook_every_use(block: Block, hook):
    """``hook`` as a forward pre-hook that fires at the block's forward and again at its checkpoint's
    recompute: registered on its first Linear, because ``apply_gradient_checkpointing`` replaces
    ``block.forward`` and the recompute calls the block's own forward, so a hook on the block itself
    fires in the forward only (half a copy-per-use bench's bytes)."""
    return block.qkv.register_forward_pre_hook(hook)


class LoRA(nn.Module):
    """``org(x) + up(down(x))`` with fp32 adapters, installed by replacing ``org.forward``."""

    def __init__(self, org: nn.Linear, rank: int, generator: torch.Generator, narrow: bool = True):
        super().__init__()
        self.narrow = narrow
        dev = org.weight.device
        self.down = nn.Parameter(torch.randn(rank, org.in_features, generator=generator, device=dev) / rank)
        self.up = nn.Parameter(torch.randn(org.out_features, rank, generator=generator, device=dev) * 1e-3)
        self.org_forward = org.forward  # reads org.weight at call time: any swap of it is seen
        org.forward = self.forward

    def forward(self, x):
        h = project_down(x, self.down) if self.narrow else F.linear(x.float(), self.down)
        return self.org_forward(x) + F.linear(h, self.up).to(x.dtype)


class Stack(nn.Module):
    def __init__(self, n: int, w: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(w, heads) for _ in range(n))
        self.loras = nn.ModuleList()

    def add_lora(self, rank: int, seed: int = 0, narrow: bool = True, in_blocks: bool = False) -> None:
        """``in_blocks``: each block owns its adapters (``block.adapters``), so an engine streaming the
        block streams them with it (optimizer offload); otherwise they live beside the blocks."""
        g = torch.Generator(self.blocks[0].qkv.weight.device).manual_seed(seed)
        for blk in self.blocks:
            loras = [LoRA(lin, rank, g, narrow) for lin in (blk.qkv, blk.out, blk.up, blk.down)]
            if in_blocks:
                blk.adapters = nn.ModuleList(loras)
            else:
                self.loras.extend(loras)

    def forward(self, x, between=None):
        """``between(i, phase)`` is called before ("pre") and after ("post") block i (musubi's hooks)."""
        for i, blk in enumerate(self.blocks):
            if between is not None:
                between(i, "pre")
            x = blk(x)
            if between is not None:
                between(i, "post")
        return x


SIZES = {"full": (24, 3072, 4096), "quick": (6, 1024, 1024), "tiny": (4, 256, 256)}  # tiny: a CPU check of the scripts


def build(size: str, device: torch.device, seed: int = 0, lora_input: str = "narrow",
          adapters_in_blocks: bool = False) -> tuple[Stack, torch.Tensor]:
    """The stack in bf16 on ``device`` (random weights), LoRA r32 (``LORA_INPUTS``; the same values
    wherever the adapters live), and its input."""
    n, w, tokens = SIZES[size]
    torch.manual_seed(seed)
    with torch.device(device):
        model = Stack(n, w, w // 128).to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_lora(32, seed, narrow=lora_input == "narrow", in_blocks=adapters_in_blocks)
    x = torch.randn(1, tokens, w, generator=torch.Generator().manual_seed(seed + 1)).to(device, torch.bfloat16)
    return model, x


def stack_step(model, x, opt, mgr=None, guarded=None):
    """One training step of the stack as the benches time it (returns the loss); ``mgr``: our
    engine, told when backward has ended; ``guarded``: a ``StepInBackward`` with ``skip_nonfinite``,
    run as the Trainer runs it under ``offload.optimizer_step_in_backward``."""
    def step():
        loss = model(x).float().pow(2).mean()
        if guarded is not None:
            guarded.watch_loss(loss)
        loss.backward()
        if guarded is not None:
            assert guarded.take_skipped() == 0  # the Trainer reads the count once a step (it syncs, as loss.item())
        if mgr is not None:
            mgr.after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def timed_steps(step, device: torch.device, steps: int, warmup: int) -> dict:
    """Run ``step()`` (one optimizer step, returns the loss) ``warmup + steps`` times; median wall
    time per step and ``max_memory_allocated`` over the timed steps.  The timed steps run with the
    heap hidden from Python's cyclic collector, as the Trainer's do (``frozen_heap``): here the first
    steps import what the Trainer imports before its loop, and full collections over that (35-145 ms
    on a 2-core CPU) fell inside timed steps; on the H200 about one step in 50 ran 85-105 ms long, on
    either side (bench/results, sixth session; that these were collections is not confirmed there)."""
    from diffsynth_core.training.collector import frozen_heap

    cuda = device.type == "cuda"
    times, losses = [], []

    def timed_step() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        losses.append(float(step()))
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)

    for _ in range(warmup):
        timed_step()
    with frozen_heap():
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            timed_step()
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {"step_s": statistics.median(times[warmup:]), "step_s_all": times, "peak_gib": peak and peak / 2**30,
            "losses": losses}


def pinned_bandwidth(device: torch.device, nbytes: int = 2**30, reps: int = 10) -> float | None:
    """GB/s of one host->device copy from a page-locked buffer (median of ``reps``)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:]) / 1e9
