"""Per-block checkpointing: same gradients, removable, composes with the offload engine."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest
import torch

from diffsynth_core.gradient import apply_gradient_checkpointing, remove_gradient_checkpointing
from diffsynth_core.gradient.checkpoint import _checkpointed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))
from offload_tiny import ToyStack, add_lora, out_tensor, tiny_dit  # noqa: E402


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


class CountingSaves:
    """Counts tensors autograd saves for backward."""

    def __init__(self):
        self.n = 0

    def __enter__(self):
        def pack(t):
            self.n += 1
            return t
        self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


@pytest.mark.parametrize("offload_activations", [False, True])
def test_checkpointing_gives_identical_gradients_and_saves_less(offload_activations):
    torch.manual_seed(0)
    model = add_lora(ToyStack(n=4), ["up", "down"])
    x = torch.randn(3, 16)
    with CountingSaves() as plain:
        ref = _grads(model, x)
    assert apply_gradient_checkpointing(model, ("blocks",), offload_activations=offload_activations) == 4
    with CountingSaves() as ckpt:
        got = _grads(model, x)
    assert ckpt.n < plain.n
    assert torch.equal(ref[0], got[0]) and all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert remove_gradient_checkpointing(model, ("blocks",)) == 4
    assert all("forward" not in b.__dict__ for b in model.blocks)
    with CountingSaves() as again:
        _grads(model, x)
    assert again.n == plain.n


def test_auto_detection_double_apply_and_no_grad():
    model = ToyStack(n=3)
    assert apply_gradient_checkpointing(model) == 3  # auto-detects model.blocks
    with pytest.raises(RuntimeError, match="already applied"):
        apply_gradient_checkpointing(model)
    with torch.no_grad():
        assert model(torch.randn(2, 16)).shape == (2, 16)
    with pytest.raises(ValueError, match="no ModuleList"):
        apply_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_tiny_dit_checkpointing_matches_plain():
    model, names, kwargs = tiny_dit("flux")
    loss = out_tensor(model(**kwargs)).pow(2).mean()
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    apply_gradient_checkpointing(model, names)
    out_tensor(model(**kwargs)).pow(2).mean().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, (p for p in model.parameters() if p.requires_grad)))


class CopiesSaves:
    """Saved-tensor hooks that keep a copy of each saved tensor, as the activation offloader keeps a
    host copy (the offloader itself only acts on CUDA tensors); records what it was handed."""

    def __init__(self):
        self.packed: list[weakref.ref] = []

    def hooks(self):
        def pack(t):
            self.packed.append(weakref.ref(t))
            return t.clone()
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


class KeywordBlock(torch.nn.Module):
    """Called the way diffusers calls Qwen-Image's and FLUX's blocks: tensors by keyword."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, *, hidden_states, shift, gain: float):
        return self.proj(hidden_states + shift) * gain


def test_block_inputs_passed_by_keyword_reach_the_hooks_and_are_not_held_by_the_checkpoint():
    torch.manual_seed(0)
    pre, block = torch.nn.Linear(8, 8), KeywordBlock()
    x, shift = torch.randn(4, 8), torch.randn(4, 8)
    plain = block(hidden_states=pre(x), shift=shift, gain=2.0).pow(2).sum()
    plain.backward()
    want = [p.grad.clone() for p in (*pre.parameters(), *block.parameters())]
    for p in (*pre.parameters(), *block.parameters()):
        p.grad = None

    saves = CopiesSaves()
    hidden = pre(x)  # an activation, as a block's input is the block before's output
    out = _checkpointed(block.forward, saves)(hidden_states=hidden, shift=shift, gain=2.0)
    assert any(ref() is hidden for ref in saves.packed)  # it went through the hooks
    kept = weakref.ref(hidden)
    del hidden
    assert kept() is None, "the checkpoint still holds a keyword input: offloading it would free nothing"
    out.pow(2).sum().backward()
    got = [p.grad for p in (*pre.parameters(), *block.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
