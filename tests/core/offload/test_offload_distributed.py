"""Data parallel without DDP: the engine averages trainable gradients over ranks (gloo on CPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffsynth_core.offload import OffloadTrainingManager
from offload_tiny import ToyStack

WORLD, STEPS = 2, 3


def _model(seed):
    torch.manual_seed(seed)
    model = ToyStack()
    for name, p in model.named_parameters():
        p.requires_grad_("up" in name or "head" in name)
    return model


def _batch(step):
    return torch.randn(4 * WORLD, 16, generator=torch.Generator().manual_seed(step))


def _train(model, mgr, rank, world):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        x = _batch(step).chunk(world)[rank]
        model(x).pow(2).mean().backward()
        if mgr is not None:
            mgr.after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


MODES = (False, True)  # enable_optimizer_cpu_offload; one spawn runs both (process start-up is the cost)


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for optimizer_offload in MODES:
            model = _model(seed=0)
            if rank:  # off on purpose: attach broadcasts rank 0's trainable weights
                with torch.no_grad():
                    for p in model.parameters():
                        if p.requires_grad:
                            p.add_(1.0)
            mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=optimizer_offload)
            _train(model, mgr, rank, WORLD)
            mgr.detach()
            torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}-{optimizer_offload}.pt"))
    finally:
        dist.destroy_process_group()
    # Every result is on disk: skip the interpreter's teardown, where gloo ranks that ran the offload
    # engine abort now and then ("terminate called without an active exception", about 1 run in 6,
    # also before this change's work); a failure above still propagates to mp.spawn.
    os._exit(0)


def test_ranks_end_identical_and_equal_to_one_process_on_the_combined_batch(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD)
    ref = _model(seed=0)
    _train(ref, None, 0, 1)
    for optimizer_offload in MODES:
        states = [torch.load(tmp_path / f"rank{r}-{optimizer_offload}.pt") for r in range(WORLD)]
        for key, want in ref.state_dict().items():
            if key == "calls":
                continue
            assert torch.equal(states[0][key], states[1][key]), (optimizer_offload, key)
            torch.testing.assert_close(states[0][key], want, rtol=1e-5, atol=1e-6)
