"""Checkpointed block inputs offloaded to pinned host memory on CUDA: same gradients, less memory."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from diffsynth_core.gradient import apply_gradient_checkpointing
from diffsynth_core.offload import OffloadTrainingManager

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
N, TOKENS, W = 8, 2048, 1024  # each block input: 4 MiB in bf16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(W, 4 * W), nn.Linear(4 * W, W)

    def forward(self, x, shift):
        return x + self.down(nn.functional.gelu(self.up(x + shift)))


class Stack(nn.Module):
    """Blocks that all take one shared tensor (packed once) and a first block that runs twice."""

    def __init__(self, by_keyword: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(N))
        self.gain = nn.Parameter(torch.ones(W))  # trainable, so the step has gradients to compare
        self.by_keyword = by_keyword  # as diffusers calls Qwen-Image's and FLUX's blocks

    def forward(self, x, shift):
        x = x * self.gain
        for block in self.blocks:
            x = block(x=x, shift=shift) if self.by_keyword else block(x, shift)
        return self.blocks[0](x, shift)


def _model(by_keyword: bool = False) -> Stack:
    torch.manual_seed(0)
    model = Stack(by_keyword).to(torch.bfloat16)
    model.requires_grad_(False)
    model.gain.requires_grad_(True)
    return model


def _steps(model, x, shift, mgr=None, steps=2):
    """Forward+backward passes: (losses, gain gradients, peak allocated bytes of the last above what
    was allocated when it began)."""
    losses, grads = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model.gain.grad = None
        loss = model(x, shift).float().pow(2).mean()
        loss.backward()
        if mgr is not None:
            mgr.after_backward()
        torch.cuda.synchronize()
        losses.append(loss.detach())
        grads.append(model.gain.grad.clone())
    return losses, grads, torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("by_keyword", [False, True])
def test_offloaded_inputs_give_identical_gradients_and_a_lower_peak(by_keyword):
    x = torch.randn(TOKENS, W, device=CUDA, dtype=torch.bfloat16)
    shift = torch.randn(TOKENS, W, device=CUDA, dtype=torch.bfloat16)  # 4 MiB, passed to every block
    runs = {}
    for offload in (False, True):
        model = _model(by_keyword).to(CUDA)
        apply_gradient_checkpointing(model, ("blocks",), offload_activations=offload)
        runs[offload] = _steps(model, x, shift)
        del model
        gc.collect()  # the checkpoint wrappers make a reference cycle: free the weights now
        torch.cuda.empty_cache()
    (l0, g0, peak_kept), (l1, g1, peak_off) = runs[False], runs[True]
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    one_input = TOKENS * W * 2
    # N + 1 block inputs are kept without offload; with it, the one in use and the ``ahead`` (2)
    # prefetched ones (``shift`` and ``x`` stay alive in the caller and are handed back as they are).
    assert peak_off <= peak_kept - (N - 3) * one_input, (peak_kept, peak_off)


def test_offloaded_inputs_with_streamed_weights_match_resident():
    x = torch.randn(TOKENS, W, device=CUDA, dtype=torch.bfloat16)
    shift = torch.randn(TOKENS, W, device=CUDA, dtype=torch.bfloat16)
    model = _model().to(CUDA)
    apply_gradient_checkpointing(model, ("blocks",))
    ref_losses, ref_grads, _ = _steps(model, x, shift, steps=3)
    model = _model()
    apply_gradient_checkpointing(model, ("blocks",), offload_activations=True)
    mgr = OffloadTrainingManager(model, CUDA, block_container_names=("blocks",), prefetch=1)
    losses, grads, _ = _steps(model, x, shift, mgr, steps=3)
    assert mgr.report()["h2d_copies"] > 0
    mgr.detach()
    for a, b in zip(ref_losses + ref_grads, losses + grads):  # kernels may differ with weight addresses
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_steady_steps_reuse_their_host_buffers():
    """Host buffers are made in the first step only; later steps reuse them, results unchanged."""
    from torch.utils.checkpoint import checkpoint

    from diffsynth_core.gradient.activation_offload import ActivationOffloader

    x = torch.randn(TOKENS, W, device=CUDA, dtype=torch.bfloat16)
    shift = torch.randn(TOKENS, W, device=CUDA, dtype=torch.bfloat16)
    model = _model().to(CUDA)
    offloader = ActivationOffloader()

    def loss_of(use_offloader: bool):
        h = x * model.gain
        for block in model.blocks:
            if use_offloader:
                with offloader.hooks():
                    h = checkpoint(block, h, shift, use_reentrant=False)
            else:
                h = checkpoint(block, h, shift, use_reentrant=False)
        return h.float().pow(2).mean()

    made, fetched = [], []
    for use in (False, True, True, True):
        model.gain.grad = None
        h2d_before = offloader.h2d_bytes
        loss = loss_of(use)
        loss.backward()
        torch.cuda.synchronize()
        if not use:
            ref = (loss.detach(), model.gain.grad.clone())
        else:
            assert torch.equal(loss.detach(), ref[0]) and torch.equal(model.gain.grad, ref[1])
            made.append(offloader.host.allocations)
            fetched.append(offloader.h2d_bytes - h2d_before)
    one_input = TOKENS * W * 2
    # backward fetches every block input but the last one packed (held on the device for it)
    assert fetched == [(N - 1) * one_input] * 3, fetched
    assert offloader.held == []  # handed over at their unpack
    # each block's input, and ``shift`` once (every block takes it)
    assert made == [N + 1] * 3, made
    assert offloader.host.most_live_bytes == (N + 1) * one_input
    assert all(b.pinned for b in offloader.host.all)
