"""Per-device settings that training and encoding need before computing on a GPU."""

from __future__ import annotations

import torch


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
