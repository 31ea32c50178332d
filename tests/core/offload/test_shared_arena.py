"""One host copy of the frozen weights per machine: 2 gloo ranks on CPU share one /dev/shm mapping."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffsynth_core.offload import OffloadTrainingManager, shared_arena
from offload_tiny import ToyStack

WORLD, STEPS = 2, 3


def _model(seed=0):
    torch.manual_seed(seed)
    model = ToyStack()
    for name, p in model.named_parameters():
        p.requires_grad_("up" in name or "head" in name)  # LoRA-like: the blocks' other weights are frozen
    return model


def _train(model, mgr, rank, world):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(4 * WORLD, 16, generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
        model(x).pow(2).mean().backward()
        if mgr is not None:
            mgr.after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _mapping_of(address: int) -> tuple[str, str]:
    """(device:inode, path) of the memory mapping holding ``address`` in this process."""
    with open("/proc/self/maps") as handle:
        for line in handle:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return f"{fields[3]}:{fields[4]}", " ".join(fields[5:])
    return "", ""


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = _model()
        mgr = OffloadTrainingManager(model, "cpu")  # several ranks: the host copy is shared by default
        inode, path = _mapping_of(mgr.arena.buffer.data_ptr())
        info = {"shared": mgr.report()["arena_shared"], "inode": inode, "path": path,
                "leader": getattr(mgr.arena, "leader", None)}
        _train(model, mgr, rank, WORLD)
        mgr.detach()
        torch.save(model.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))

        shared_arena.SHM_DIR = "/nonexistent-shm"  # no shared memory here: each rank falls back to its own
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fallback = OffloadTrainingManager(_model(), "cpu")
        info["fallback_shared"] = fallback.report()["arena_shared"]
        info["fallback_warned"] = any("cannot share" in str(w.message) for w in caught)
        fallback.detach()
        shared_arena.SHM_DIR = "/dev/shm"

        try:  # rank 1 loads other frozen weights: refused on every rank, never silently averaged away
            OffloadTrainingManager(_model(seed=rank), "cpu")
            info["mismatch"] = "accepted"
        except RuntimeError as err:
            info["mismatch"] = str(err)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
            json.dump(info, handle)
    finally:
        dist.destroy_process_group()
    # Every result is on disk: skip the interpreter's teardown, where gloo ranks that ran the offload
    # engine abort now and then ("terminate called without an active exception", about 1 run in 6,
    # also before this change's work); a failure above still propagates to mp.spawn.
    os._exit(0)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_two_ranks_share_one_host_copy_and_train_like_one_process(tmp_path):
    before = set(os.listdir("/dev/shm"))
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD)
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(i["shared"] for i in infos) and [i["leader"] for i in infos] == [True, False]
    assert infos[0]["inode"] == infos[1]["inode"] and infos[0]["path"].startswith("/dev/shm/splitflow-arena-")
    assert infos[0]["path"].endswith("(deleted)")  # unlinked once both mapped: nothing can leak
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("splitflow-arena-")}

    ref = _model()
    _train(ref, None, 0, 1)  # one process accumulating both ranks' samples
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for key, want in ref.state_dict().items():
        if key != "calls":
            assert torch.equal(states[0][key], states[1][key]), key
            torch.testing.assert_close(states[0][key], want, rtol=1e-5, atol=1e-6)

    assert all(not i["fallback_shared"] and i["fallback_warned"] for i in infos)
    assert all("other frozen weights" in i["mismatch"] for i in infos)


def _cuda_worker(rank, init_file, out_dir):
    """Both ranks on the one GPU (gloo): each page-locks its own mapping of the shared host copy."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = _model()
        mgr = OffloadTrainingManager(model, "cuda")
        report = mgr.report()
        _train_cuda(model, mgr, rank, WORLD)
        mgr.detach()
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, os.path.join(out_dir, f"cuda{rank}.pt"))
        with open(os.path.join(out_dir, f"cuda{rank}.json"), "w") as handle:
            json.dump({"shared": report["arena_shared"], "pinned": report["pinned"]}, handle)
    finally:
        dist.destroy_process_group()


def _train_cuda(model, mgr, rank, world):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        x = torch.randn(4 * WORLD, 16, generator=torch.Generator().manual_seed(step)).chunk(world)[rank].cuda()
        model(x).pow(2).mean().backward()
        if mgr is not None:
            mgr.after_backward()
        else:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.gpu
def test_two_ranks_on_cuda_pin_one_shared_host_copy(tmp_path):
    mp.spawn(_cuda_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD)
    infos = [json.loads((tmp_path / f"cuda{r}.json").read_text()) for r in range(WORLD)]
    assert all(i["shared"] and i["pinned"] for i in infos)
    ref = _model().cuda()
    _train_cuda(ref, None, 0, 1)  # one process accumulating both ranks' samples
    states = [torch.load(tmp_path / f"cuda{r}.pt") for r in range(WORLD)]
    for key, want in ref.state_dict().items():
        if key != "calls":
            assert torch.equal(states[0][key], states[1][key]), key
            torch.testing.assert_close(states[0][key], want.cpu(), rtol=1e-4, atol=1e-5)
