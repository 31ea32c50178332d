"""Per-block gradient checkpointing that composes with the offload engine.

Each block's ``forward`` is wrapped (an instance attribute, so ``remove`` restores the class method)
in non-reentrant ``torch.utils.checkpoint``.  The module's own ``__call__`` and hooks stay outside
the checkpoint, so the offload engine sees one forward per block; in backward its gradient hook
loads the block *before* the recompute, and the recompute and the backward share that one copy.
``offload_activations`` also keeps the checkpointed inputs in host memory (pinned when the
activations live on CUDA) until backward needs them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..offload.units import find_block_containers

_MARK = "_splitflow_checkpointed"


def _blocks(model: nn.Module, block_container_names) -> list[nn.Module]:
    containers = find_block_containers(model, block_container_names)
    if not containers:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to checkpoint; "
                         "pass block_container_names")
    return [b for _, cont in containers for b in cont.children()]


def apply_gradient_checkpointing(model: nn.Module, block_container_names=None,
                                 offload_activations: bool = False) -> int:
    """Checkpoint every child of the named (or auto-detected) block containers; returns how many."""
    blocks = _blocks(model, block_container_names)
    if any(_MARK in b.__dict__ for b in blocks):
        raise RuntimeError("gradient checkpointing is already applied to these blocks")
    for block in blocks:
        block.forward = _checkpointed(block.forward, offload_activations)
        block.__dict__[_MARK] = True
    return len(blocks)


def remove_gradient_checkpointing(model: nn.Module, block_container_names=None) -> int:
    """Undo :func:`apply_gradient_checkpointing`; returns how many blocks were restored."""
    n = 0
    for block in _blocks(model, block_container_names):
        if block.__dict__.pop(_MARK, False):
            del block.forward
            n += 1
    return n


def _checkpointed(forward, offload_activations: bool):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with _activation_context(offload_activations, args, kwargs):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def _activation_context(offload: bool, args, kwargs):
    if not offload:
        return contextlib.nullcontext()
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    pin = any(t.is_cuda for t in tensors)  # pinning is a CUDA call: only when activations are on CUDA
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)
