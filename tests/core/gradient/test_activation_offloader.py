"""The activation offloader's bookkeeping on CPU tensors (``cpu_tensors=True``: synchronous copies
into pageable buffers): what is copied back, what is held, what is prefetched.  The GPU tests
(test_activation_offload_gpu.py) check the same on CUDA streams, with peaks."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from diffsynth_core.gradient.activation_offload import ActivationOffloader

N, TOKENS, W = 6, 64, 32
ONE_INPUT = TOKENS * W * 4  # fp32 bytes of one block input


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x, shift):
        return x + torch.tanh(self.lin(x + shift))


def _setup():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(N))
    x, shift = torch.randn(TOKENS, W), torch.randn(TOKENS, W)  # ``shift``: every block takes it
    return blocks, x, shift


def _step(blocks, carried: tuple, shared: tuple = (), offloader=None):
    """Forward (each block checkpointed, its inputs through ``offloader``) and backward; the loss
    and the gradients.  ``carried`` flow from block to block (scaled first, so the caller holds
    none of the first block's inputs past it); ``shared`` go to every block as they are."""
    blocks.zero_grad(set_to_none=True)
    hs = tuple(t * 1.5 for t in carried)
    for block in blocks:
        with offloader.hooks() if offloader is not None else contextlib.nullcontext():
            out = checkpoint(block, *hs, *shared, use_reentrant=False)
        hs = out if isinstance(out, tuple) else (out,)
    loss = sum(h.pow(2).mean() for h in hs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in blocks.parameters()]


def test_each_block_input_comes_back_once_but_the_last_and_the_shared_one():
    blocks, x, shift = _setup()
    ref_loss, ref_grads = _step(blocks, (x,), (shift,))
    offloader = ActivationOffloader(min_bytes=0, cpu_tensors=True)
    made = []
    for _ in range(3):
        d2h, h2d = offloader.d2h_bytes, offloader.h2d_bytes
        loss, grads = _step(blocks, (x,), (shift,), offloader)
        assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
        # out: every block input, and ``shift`` once; back: every block input but the last one
        # (held for backward, which needs it first), ``shift`` never (the caller holds it)
        assert offloader.d2h_bytes - d2h == (N + 1) * ONE_INPUT
        assert offloader.h2d_bytes - h2d == (N - 1) * ONE_INPUT
        assert offloader.held == []  # handed over at their unpack
        made.append(offloader.host.allocations)
    assert offloader.fetched_on_demand == 0  # each block's inputs were on their way before its recompute
    # buffers come back when autograd frees its saved tensors; when that happens differs between
    # torch versions (2.11 frees the first step's a step later), so only the last step is checked
    assert made[0] == N + 1 and made[-1] == made[-2], made


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_backward_brings_inputs_back_that_many_blocks_ahead_of_their_recompute(ahead):
    blocks, x, shift = _setup()
    offloader = ActivationOffloader(min_bytes=0, cpu_tensors=True, ahead=ahead)
    calls, fetched_at = [], {}

    def note(block_index):
        def hook(_module, _args):
            calls.append(block_index)
            if calls.count(block_index) == 2:  # its recompute in backward: its inputs are unpacked
                fetched_at[block_index] = offloader.h2d_bytes // ONE_INPUT
        return hook
    handles = [b.register_forward_pre_hook(note(i)) for i, b in enumerate(blocks)]
    _step(blocks, (x,), (shift,), offloader)
    for h in handles:
        h.remove()
    # The last block's input is held; each recompute has brought back the inputs of ``ahead``
    # blocks before it (every one of the N - 1 others, at most), each copied once.
    assert fetched_at == {j: min(N - 1, N - 1 - j + ahead) for j in range(N)}, fetched_at
    assert offloader.fetched_on_demand == 0
    with pytest.raises(ValueError, match="ahead"):
        ActivationOffloader(ahead=0)


def test_an_input_changed_in_place_after_packing_comes_back_from_the_host_copy():
    blocks, x, shift = _setup()
    offloader = ActivationOffloader(min_bytes=0, cpu_tensors=True)
    h = x * 1.5
    with offloader.hooks():
        out = checkpoint(blocks[0], h, shift, use_reentrant=False)
    expected = torch.autograd.grad(checkpoint(blocks[0], x * 1.5, shift, use_reentrant=False).sum(),
                                   list(blocks[0].parameters()))
    h.mul_(0)  # the held tensor changes: backward must read what was packed
    got = torch.autograd.grad(out.sum(), list(blocks[0].parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert offloader.h2d_bytes == ONE_INPUT and offloader.fetched_on_demand == 1


class TwoStreamBlock(nn.Module):
    """Two fresh inputs a block (image and text streams, as Qwen-Image's blocks take them)."""

    def __init__(self):
        super().__init__()
        self.img, self.txt = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, img, txt):
        mixed = torch.tanh(self.img(img) + self.txt(txt))
        return img + mixed, txt - mixed


def test_two_stream_blocks_bring_each_input_back_once():
    torch.manual_seed(0)
    blocks = nn.ModuleList(TwoStreamBlock() for _ in range(N))
    img, txt = torch.randn(TOKENS, W), torch.randn(TOKENS, W)
    ref_loss, ref_grads = _step(blocks, (img, txt))
    offloader = ActivationOffloader(min_bytes=0, cpu_tensors=True)
    for _ in range(2):
        h2d = offloader.h2d_bytes
        loss, grads = _step(blocks, (img, txt), offloader=offloader)
        assert torch.equal(loss, ref_loss) and all(torch.equal(x, y) for x, y in zip(grads, ref_grads))
        assert offloader.h2d_bytes - h2d == 2 * (N - 1) * ONE_INPUT  # both of the last block's held
        assert offloader.held == [] and offloader.fetched_on_demand == 0


def test_the_model_keeps_its_offloader_for_telemetry():
    from diffsynth_core.gradient import (activation_offloader, apply_gradient_checkpointing,
                                         remove_gradient_checkpointing)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(W, W) for _ in range(2))

    model = Model()
    apply_gradient_checkpointing(model, ("blocks",))
    assert activation_offloader(model) is None  # not asked for
    remove_gradient_checkpointing(model, ("blocks",))
    apply_gradient_checkpointing(model, ("blocks",), offload_activations=True)
    offloader = activation_offloader(model)
    assert isinstance(offloader, ActivationOffloader)
    assert offloader.stats() == {"d2h_bytes": 0, "h2d_bytes": 0, "fetched_on_demand": 0,
                                 "host_buffer_bytes": 0, "host_buffer_allocations": 0}
    remove_gradient_checkpointing(model, ("blocks",))
    assert activation_offloader(model) is None
