"""Is LoRA's down projection, with its input's gradient made in slices of rows, bitwise autograd's?

    python -m bench.adapter_slices            # on a CUDA machine

``diffsynth_core/training/adapter_inputs.py`` makes the input's fp32 gradient in slices of
256-multiples of rows; cuBLAS picks its kernel by shape, so whether a slice gives the whole
product's bits is a property of the library measured here, over a grid of token counts, input
widths (DiT MLPs: 3072 to 15360) and ranks, against autograd of peft's cast (``F.linear(x.float(),
w)``).  Prints one JSON line: how many shapes, how many of them sliced, which were not bitwise.
"""

from __future__ import annotations

import itertools
import json

import torch
from torch.nn import functional as F

from diffsynth_core.training.adapter_inputs import project_down, rows_per_slice

TOKENS = (256, 1024, 2048, 4096, 4608, 8192, 12288, 16384)
WIDTHS = (3072, 5120, 8960, 12288, 13824, 15360)
RANKS = (4, 16, 32, 64, 128)


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    not_bitwise, shapes, sliced = [], 0, 0
    for tokens, width, rank in itertools.product(TOKENS, WIDTHS, RANKS):
        x = torch.randn(1, tokens, width, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
        w = (torch.randn(rank, width, device=dev, generator=gen) * 0.02).requires_grad_(True)
        grad_out = torch.randn(1, tokens, rank, device=dev, generator=gen)
        ours = torch.autograd.grad(project_down(x, w), (x, w), grad_out)
        theirs = torch.autograd.grad(F.linear(x.float(), w), (x, w), grad_out)
        shapes += 1
        sliced += rows_per_slice(tokens, w) > 0
        if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
            not_bitwise.append((tokens, width, rank))
    print(json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "shapes": shapes,
                      "sliced_shapes": sliced, "not_bitwise": not_bitwise}))


if __name__ == "__main__":
    main()
