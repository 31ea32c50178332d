"""``StepInBackward`` on the CPU: each page of weights steps as soon as backward has produced its
gradients, its state kept in a host arena between steps.  The order of steps and the arithmetic are
those of a GPU run (the GPU's own tests also check memory: test_optimizer_state_gpu.py); here: the
result is bitwise that of one ``optimizer.step()`` after backward, with gradient checkpointing too,
checkpoints resume bitwise, and what it cannot do is refused in one line."""

from __future__ import annotations

import io

import pytest
import torch

from diffsynth_core.offload.backward_steps import StepInBackward

from offload_tiny import CHAIN_DEPTH as DEPTH, CHAIN_WIDTH as WIDTH, Chain, assert_same_runs, state_tensors
from offload_tiny import chain_optimizer as _optimizer, train_chain as _train


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("kind", ["adamw", "fused", "sgd"])
def test_steps_in_backward_are_bitwise_one_step_after_backward(kind, checkpointed):
    runs = []
    for in_backward in (False, True):
        model = Chain(checkpointed)
        optimizer = _optimizer(kind, model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))  # lr changes every step
        pager = StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4) if in_backward else None
        losses = _train(model, optimizer, range(5), scheduler)
        if pager is not None:
            assert len(pager.pages) >= DEPTH  # a Linear's weight fills a page
            assert pager.stats["pages_stepped"] == 5 * len(pager.pages)
            assert pager.stats["h2d_bytes"] == 4 * sum(page.state.arena.nbytes for page in pager.pages)
            assert all(p.grad is None for p in model.parameters())  # freed as each page stepped
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert_same_runs(runs)


def test_pages_step_in_the_order_backward_produces_the_gradients():
    model = Chain(checkpointed=False)
    optimizer = _optimizer("adamw", model.parameters())
    pager = StepInBackward(optimizer, page_bytes=1)  # every weight its own page
    _train(model, optimizer, range(2))
    order = [id(page.params[0]) for page in pager.pages]
    assert len(order) == 2 * DEPTH
    assert order[0] in {id(p) for p in model.layers[-1].parameters()}  # the last layer's gradients come first
    assert set(order[-2:]) == {id(p) for p in model.layers[0].parameters()}


def _paged_run_with_checkpoint_at_3():
    """A paged run: its model and optimizer after step 6, the checkpoint it took at step 3, and the
    losses of steps 4-6."""
    model = Chain(checkpointed=True)
    optimizer = _optimizer("adamw", model.parameters())
    StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4)
    _train(model, optimizer, range(3))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    expected = _train(model, optimizer, range(3, 6))
    saved.seek(0)
    return model, optimizer, torch.load(saved, weights_only=True), expected


def test_a_checkpoint_resumes_bitwise():
    model, _, ckpt, expected = _paged_run_with_checkpoint_at_3()
    resumed = Chain(checkpointed=True)
    resumed.load_state_dict(ckpt["model"])
    optimizer = _optimizer("adamw", resumed.parameters())
    pager = StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4)
    optimizer.load_state_dict(ckpt["optimizer"])
    # no page is laid out before the first step: the loaded state waits in one host arena meanwhile
    homes = set(map(id, pager.loaded.homes.values()))
    assert homes == {id(t) for t in state_tensors(optimizer)} and len(homes) == 2 * len(list(resumed.parameters()))
    assert _train(resumed, optimizer, range(3, 6)) == expected
    assert pager.loaded is None  # every weight's state moved on to its page in the first step
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_loading_a_checkpoint_into_a_running_pager_replaces_the_paged_state():
    model, optimizer, ckpt, expected = _paged_run_with_checkpoint_at_3()
    model.load_state_dict(ckpt["model"])  # back to step 3, in the same process: the pages exist already
    optimizer.load_state_dict(ckpt["optimizer"])
    assert _train(model, optimizer, range(3, 6)) == expected


def test_a_checkpoint_without_the_pages_state_drops_their_arenas_and_steps_like_a_fresh_optimizer():
    model = Chain(checkpointed=True)
    optimizer = _optimizer("adamw", model.parameters())
    empty = optimizer.state_dict()  # taken before any step: no state per weight
    pager = StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4)
    _train(model, optimizer, range(3))
    assert pager._arenas and all(page.state is not None for page in pager.pages)
    optimizer.load_state_dict(empty)
    assert pager._arenas == [] and all(page.state is None for page in pager.pages)  # unpinned now
    fresh = Chain(checkpointed=True)
    fresh.load_state_dict(model.state_dict())
    expected = _train(fresh, _optimizer("adamw", fresh.parameters()), range(3, 5))
    assert _train(model, optimizer, range(3, 5)) == expected


def test_gradient_accumulation_is_refused_in_one_line():
    model = Chain(checkpointed=False)
    optimizer = _optimizer("adamw", model.parameters())
    StepInBackward(optimizer)
    model(torch.randn(4, WIDTH)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        model(torch.randn(4, WIDTH)).pow(2).mean().backward()


def test_a_weight_without_a_gradient_keeps_its_state_and_the_others_step():
    model = Chain(checkpointed=False)
    optimizer = _optimizer("adamw", model.parameters())
    pager = StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4)
    _train(model, optimizer, range(2))
    frozen, other = model.layers[2].weight, model.layers[3].weight
    before, other_before = frozen.detach().clone(), other.detach().clone()
    frozen.requires_grad_(False)  # this step it gets no gradient
    _train(model, optimizer, range(2, 3))
    assert torch.equal(frozen, before) and not torch.equal(other, other_before)
    assert all(p.grad is None for p in model.parameters())
    assert not pager.pending and all(not page.ready for page in pager.pages)


# --- skip_nonfinite: what the Trainer's offload.optimizer_step_in_backward uses ----------------------
def test_a_page_with_an_inf_gradient_keeps_its_weights_and_state_and_the_others_step_bitwise():
    runs = []
    for in_backward in (False, True):
        model = Chain(checkpointed=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        pager = StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4, skip_nonfinite=True) if in_backward else None
        _train(model, optimizer, range(2))
        layer = list(model.layers[2].parameters())  # the page the poisoned weight is in (its bias too)
        poisoned = model.layers[2].weight
        state_before = {k: v.clone() for k, v in optimizer.state[poisoned].items()}
        weight_before = poisoned.detach().clone()
        if pager is None:  # the reference: every weight but that page's steps, in one step()
            for p in layer:
                p.requires_grad_(False)
            _train(model, optimizer, range(2, 3))
            for p in layer:
                p.requires_grad_(True)
        else:
            assert {id(p) for p in pager.page_of[id(poisoned)].params} == {id(p) for p in layer}
            # a finite loss whose gradient overflows in one weight, which only its page can see
            handle = poisoned.register_hook(lambda grad: grad * float("inf"))
            _train(model, optimizer, range(2, 3))
            handle.remove()
            assert pager.take_skipped() == 1  # the poisoned weight's page, and only it
            assert torch.equal(poisoned, weight_before)  # no Inf written, the weight did not move
            for key, value in optimizer.state[poisoned].items():  # nor its moments, nor its step count
                assert torch.equal(value, state_before[key]), key
        _train(model, optimizer, range(3, 5))
        runs.append([p.detach().clone() for p in model.parameters()])
    for expected, got in zip(*runs):
        assert torch.equal(expected, got)


def test_a_nan_loss_skips_every_page():
    model = Chain(checkpointed=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # made first, as the Trainer makes it: its wrapper of optimizer.step must not become the pages' step
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    pager = StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4, skip_nonfinite=True)
    _train(model, optimizer, range(2))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(32, WIDTH)
    x[0, 0] = float("nan")  # one NaN input: the loss is NaN, yet most gradients come out finite
    loss = model(x).pow(2).mean()
    pager.watch_loss(loss)
    loss.backward()
    optimizer.step()
    assert pager.take_skipped() == len(pager.pages)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert pager.take_skipped() == 0  # the count and the loss flag start over


def test_skipping_needs_a_fused_optimizer():
    with pytest.raises(ValueError, match="needs a fused optimizer"):
        StepInBackward(_optimizer("adamw", Chain().parameters()), skip_nonfinite=True)
