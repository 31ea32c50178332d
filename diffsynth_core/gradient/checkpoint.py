"""Per-block gradient checkpointing that composes with the offload engine.

Each block's ``forward`` is wrapped (an instance attribute, so ``remove`` restores the class method)
in non-reentrant ``torch.utils.checkpoint``.  The module's own ``__call__`` and hooks stay outside
the checkpoint, so the offload engine sees one forward per block; in backward its gradient hook
loads the block *before* the recompute, and the recompute and the backward share that one copy.
``offload_activations`` also keeps the checkpointed inputs of CUDA blocks in pinned host memory
until backward needs them, copied on side streams (``activation_offload.py``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..offload.units import find_blocks
from .activation_offload import ActivationOffloader

_MARK = "_splitflow_checkpointed"
_OFFLOADER = "_splitflow_activation_offloader"  # on the model: its offloader, for telemetry


def _blocks(model: nn.Module, block_container_names) -> list[nn.Module]:
    blocks = find_blocks(model, block_container_names)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to checkpoint; "
                         "pass block_container_names")
    return blocks


def apply_gradient_checkpointing(model: nn.Module, block_container_names=None,
                                 offload_activations: bool = False) -> int:
    """Checkpoint every child of the named (or auto-detected) block containers; returns how many."""
    blocks = _blocks(model, block_container_names)
    if any(_MARK in b.__dict__ for b in blocks):
        raise RuntimeError("gradient checkpointing is already applied to these blocks")
    offloader = ActivationOffloader() if offload_activations else None  # one for all: it links the blocks
    for block in blocks:
        block.forward = _checkpointed(block.forward, offloader)
        block.__dict__[_MARK] = True
    if offloader is not None:
        model.__dict__[_OFFLOADER] = offloader
    return len(blocks)


def activation_offloader(model: nn.Module) -> ActivationOffloader | None:
    """The offloader :func:`apply_gradient_checkpointing` gave ``model`` (``offload_activations``), if any."""
    return model.__dict__.get(_OFFLOADER)


def remove_gradient_checkpointing(model: nn.Module, block_container_names=None) -> int:
    """Undo :func:`apply_gradient_checkpointing`; returns how many blocks were restored."""
    n = 0
    model.__dict__.pop(_OFFLOADER, None)
    for block in _blocks(model, block_container_names):
        if block.__dict__.pop(_MARK, False):
            del block.forward
            n += 1
    return n


def _checkpointed(forward, offloader: ActivationOffloader | None):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        call, args, kwargs = _tensors_positional(forward, args, kwargs)
        with offloader.hooks() if offloader is not None else contextlib.nullcontext():
            return checkpoint(call, *args, use_reentrant=False, **kwargs)
    return run


def _tensors_positional(forward, args: tuple, kwargs: dict):
    """``(call, args, kwargs)`` with the tensors of ``kwargs`` moved into ``args``.

    Why: non-reentrant checkpoint saves its positional inputs through the saved-tensor hooks but
    keeps keyword arguments by reference in its recompute closure (torch/utils/checkpoint.py,
    ``_checkpoint_without_reentrant_generator``: ``new_frame.save_inputs(*args)``, ``recompute_fn``
    calls ``fn(*args, **kwargs)``), and it reads the devices whose RNG state it restores from the
    positional ones only.  diffusers calls Qwen-Image's and FLUX's blocks with keywords
    (``block(hidden_states=..., encoder_hidden_states=..., ...)``), so without this their block
    inputs would stay on the GPU whatever the activation offloader does with them.
    """
    names = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
    if not names:
        return forward, args, kwargs
    rest = {name: value for name, value in kwargs.items() if name not in names}
    n = len(args)

    def call(*inputs, **more):
        return forward(*inputs[:n], **dict(zip(names, inputs[n:])), **more)
    return call, (*args, *(kwargs[name] for name in names)), rest
