"""Pinned host<->device bandwidth one way at a time and both ways at once (two streams, 1 GiB).

    python3 bench/pcie_duplex.py      # prints {"h2d_gb_s", "d2h_gb_s", "both_each_gb_s"}

Tells whether copies out (optimizer state, offloaded activations) slow the copies in that a
streamed forward waits for.
"""

import json
import time

import torch

N = 2**30


def bandwidth(h2d: bool, d2h: bool, reps: int = 10) -> float:
    """GB/s of each direction that runs (each copy on its own stream)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        if h2d:
            with torch.cuda.stream(STREAMS[0]):
                DEV[0].copy_(HOST[0], non_blocking=True)
        if d2h:
            with torch.cuda.stream(STREAMS[1]):
                HOST[1].copy_(DEV[1], non_blocking=True)
    torch.cuda.synchronize()
    return reps * N / (time.perf_counter() - t0) / 1e9


if __name__ == "__main__":
    HOST = [torch.empty(N, dtype=torch.uint8).pin_memory() for _ in range(2)]
    DEV = [torch.empty(N, dtype=torch.uint8, device="cuda") for _ in range(2)]
    STREAMS = [torch.cuda.Stream(), torch.cuda.Stream()]
    bandwidth(True, True, 2)  # warm-up
    print(json.dumps({"h2d_gb_s": bandwidth(True, False), "d2h_gb_s": bandwidth(False, True),
                      "both_each_gb_s": bandwidth(True, True)}))
