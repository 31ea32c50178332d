"""train.deterministic sets up repeatable kernels and seeds (process-wide, so checked in a child)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_CHILD = r"""
import os, random, sys
sys.path.insert(0, {root!r})
import numpy, torch
from diffsynth_core.training.device import configure_determinism
os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
configure_determinism(False, 3)
assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
configure_determinism(True, 3)
assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
assert not torch.backends.cuda.cudnn_sdp_enabled()
draws = (random.random(), numpy.random.rand(), torch.rand(()).item())
configure_determinism(True, 3)
assert draws == (random.random(), numpy.random.rand(), torch.rand(()).item())
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
configure_determinism(True, 3)
assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # a user's own setting is kept
print("ok")
"""


def test_deterministic_mode_sets_kernels_workspace_and_seeds():
    out = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT))], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
