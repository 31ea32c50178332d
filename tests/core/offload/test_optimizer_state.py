"""``HostOptimizerState`` on the CPU: the state lives in host pages between steps, copied in as one
buffer before ``step()`` and out as one copy after it (host to host here, the same bookkeeping as
on a GPU, whose own tests check memory and pinning: test_optimizer_state_gpu.py)."""

from __future__ import annotations

import io

import pytest
import torch

from diffsynth_core.offload.optimizer_state import HostOptimizerState
from offload_tiny import Chain, assert_same_runs, chain_optimizer as _optimizer, state_tensors
from offload_tiny import train_chain as _train


def _homes(keeper):
    return {id(home) for page in keeper.pages for home in page.homes.values()}


@pytest.mark.parametrize("kind", ["adamw", "fused", "sgd"])
def test_paged_state_steps_bitwise_like_state_left_in_place(kind):
    runs = []
    for paged in (False, True):
        model = Chain()
        optimizer = _optimizer(kind, model.parameters())
        keeper = HostOptimizerState(optimizer) if paged else None
        losses = _train(model, optimizer, range(5))
        if keeper is not None:
            state = state_tensors(optimizer)
            assert state and {id(v) for v in state} <= _homes(keeper)  # between steps: at home
            assert len(keeper.pages) == 1 and keeper.stats["h2d_bytes"] == 4 * keeper.stats["host_bytes"]
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert_same_runs(runs)


def test_only_the_keys_asked_for_are_paged():
    model = Chain()
    optimizer = _optimizer("adamw", model.parameters())
    keeper = HostOptimizerState(optimizer, keys=("exp_avg_sq",))
    _train(model, optimizer, range(2))
    homes = _homes(keeper)
    for entry in optimizer.state.values():
        assert id(entry["exp_avg_sq"]) in homes and id(entry["exp_avg"]) not in homes


def test_a_checkpoint_resumes_bitwise_into_a_fresh_and_into_a_running_keeper():
    model = Chain()
    optimizer = _optimizer("adamw", model.parameters())
    HostOptimizerState(optimizer)
    _train(model, optimizer, range(3))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    expected = _train(model, optimizer, range(3, 6))

    def load():  # a copy each time: on the CPU, load_state_dict keeps the loaded tensors (AdamW's step counts)
        saved.seek(0)
        return torch.load(saved, weights_only=True)

    ckpt = load()
    fresh = Chain()
    fresh.load_state_dict(ckpt["model"])
    optimizer2 = _optimizer("adamw", fresh.parameters())
    HostOptimizerState(optimizer2)
    optimizer2.load_state_dict(ckpt["optimizer"])
    assert _train(fresh, optimizer2, range(3, 6)) == expected

    ckpt = load()
    model.load_state_dict(ckpt["model"])  # the running one: its pages exist already
    optimizer.load_state_dict(ckpt["optimizer"])
    assert _train(model, optimizer, range(3, 6)) == expected
