"""``train.compile_blocks``: each transformer block's forward compiled by ``torch.compile``.

Why: on the H200 a real-width Qwen-Image step is host-bound.  The GPU runs ~1 ms behind the
host's kernel launches, resident or offloaded (``gpu_lag_ms`` in
``bench/results/offload_qwen_lag_h200.json`` at 8b1d56c), and py-spy puts most of the host's time in the
model's own module code (``bench/results/offload_fp8_pyspy_summary_h200.json`` at 8b1d56c).  A compiled
block runs as one graph: fewer Python calls and, with fused elementwise kernels, fewer launches.

Only the blocks' ``forward`` is compiled, not the module call, so the hooks around a block (the
offload engine's loads, gradient checkpointing, activation offload) stay eager and work as
before; identical blocks share one compiled graph (regional compilation), so compiling costs
about one block's worth, once per process (one more graph for the first block, whose input needs
no gradient).  Compiled kernels round differently from eager ones, so a compiled run matches an
eager one closely, not bitwise; a compiled run is repeatable on the CPU (tests).  On the H200 it
takes the all-resident real-width Qwen-Image step from 0.94-1.05 s to 0.69-0.71 s
(``bench/results/offload_compiled_*_h200.json`` at 8b1d56c; docs/training.md).

A block that cannot be compiled on this machine (no C++ compiler for a CPU target, no Triton for
a GPU) stops the run at its first step with an :class:`~diffsynth_core.errors.InputError` that
says to turn the option off.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..errors import InputError
from ..offload.units import find_blocks

_MARK = "_splitflow_compiled"


def compile_blocks(model: nn.Module, block_container_names=None) -> int:
    """Compile the forward of every child of the model's block containers; returns how many."""
    blocks = find_blocks(model, block_container_names)
    if not blocks:
        raise InputError(f"train.compile_blocks: {type(model).__name__} has no list of blocks to compile; "
                         "set train.compile_blocks = false")
    for block in blocks:
        if _MARK not in block.__dict__:
            block.forward = _compiled(block.forward)
            block.__dict__[_MARK] = True
    return len(blocks)


def _compiled(forward):
    compiled = torch.compile(forward)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as err:  # the compiler, not the model, failed
            raise InputError(f"train.compile_blocks: torch.compile cannot compile the blocks on this machine "
                             f"({_reason(err)}); set train.compile_blocks = false") from err
    return run


def _reason(err: Exception) -> str:
    """The compiler's own complaint, on one line (Dynamo wraps it: ``backend='inductor' raised: ...``)."""
    inner = getattr(err, "inner_exception", None) or err
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    named = text.split(" ")[0].endswith(":")  # already "SomeError: ..."
    return (text if named else f"{type(inner).__name__}: {text}")[:300]
