"""Stage 1 within a cheap GPU's memory, at the released encoders' real widths and depths (CUDA only).

Runs the benchmark's memory step (``bench/preprocess.py``): random weights in the released layouts,
offloaded, one part, ``preprocess.vram_budget_gb`` as the issue sets it.  With
``SPLITFLOW_BENCH_OUT`` set, the figures are written there as JSON.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
def test_released_encoders_fit_the_budget(family, tmp_path):
    from bench.preprocess import Bench

    from diffsynth_core.training.device import avoid_broken_kernels

    avoid_broken_kernels("cuda")
    out = os.environ.get("SPLITFLOW_BENCH_OUT")
    report: dict = {"device": torch.cuda.get_device_name()}
    args = SimpleNamespace(tiny=False, images=4, batch=4, out=None)
    bench = Bench(args, family, tmp_path, report)
    bench.memory()
    if out:
        with open(os.path.join(out, f"memory_{family}.json"), "w") as handle:
            json.dump(report, handle, indent=2)
    result = report[family]["memory"]
    assert result["encoded"] >= 1
    assert result["within_budget"], result  # Qwen-Image 1328^2 and FLUX.1-dev 1024^2 <= 8 GB; Wan 81x480x832 <= 12 GB
