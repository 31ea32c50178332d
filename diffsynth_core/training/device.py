"""Per-device settings that training and encoding need before computing on a GPU."""

from __future__ import annotations

import os
import random
import warnings

import torch

# cuBLAS picks its reduction order from the workspace it is given; a fixed configuration makes it
# repeatable (NVIDIA's "results reproducibility" rule).  PyTorch reads it once, at the first cuBLAS call.
CUBLAS_WORKSPACE = ":4096:8"


def avoid_broken_kernels(device: torch.device | str) -> torch.device:
    """Turn off kernels known to give wrong results on ``device``; returns the device.

    torch 2.11's cuDNN attention backend produced NaN gradients (tiny FLUX, bf16) and an illegal
    memory access (full-size FLUX) on the H200, with or without offload, while every other SDPA
    backend agreed; so CUDA runs use the flash / memory-efficient / math backends instead.
    This is process-wide (a torch backend flag), which is why only entry points call it.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device


def configure_determinism(enabled: bool, seed: int) -> None:
    """``train.deterministic``: bitwise repeatable CUDA runs (and seeded host RNGs).

    Sets, process-wide: ``CUBLAS_WORKSPACE_CONFIG`` (unless the user set one), deterministic
    algorithms with errors rather than warnings (flash and memory-efficient attention then take
    their deterministic backward, which accumulates dQ without atomics; an op that has no
    deterministic kernel raises instead of silently varying), cuDNN deterministic without
    autotuning, cuDNN attention off (it is off anyway, see ``avoid_broken_kernels``), and seeds
    Python's, NumPy's and torch's RNGs.  Costs speed (see docs/offload.md); without it the loss of
    two identical CUDA runs drifts apart by ~1e-4 from the first step, while CPU runs are exact.
    """
    if not enabled:
        return
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_initialized():
            warnings.warn("train.deterministic: CUDA was already used in this process, so cuBLAS may keep its "
                          f"default workspace; export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before starting "
                          "for a guaranteed repeatable run", RuntimeWarning, stacklevel=2)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for the engine
        pass
    torch.manual_seed(seed)  # every device's generator
