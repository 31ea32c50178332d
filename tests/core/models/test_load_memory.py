"""Loading in bf16 costs about 1x the model in RAM, not 2x (measured in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHILD = r"""
import json, sys, torch
def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))
from diffsynth_core.models import get_family
import accelerate, diffusers, peft, safetensors.torch, transformers  # imported before the baseline
from diffusers import QwenImageTransformer2DModel  # diffusers imports model modules lazily
spec, mode, folder = get_family("qwen_image"), sys.argv[1], sys.argv[2]
base = status("VmRSS")
if mode == "file":
    model = spec.load_transformer_file(folder + "/dit.safetensors", folder, torch.bfloat16)
else:
    model = spec.load_components(folder, ("transformer",), torch.bfloat16, "cpu")["transformer"]
touched = sum(float(p.sum()) for p in model.parameters())  # page every weight in
assert all(p.dtype == torch.bfloat16 for p in model.parameters())
print(json.dumps({"peak": status("VmHWM") - base}))
"""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A ~150 MB bf16 Qwen-Image transformer saved as a folder and as one prefixed file."""
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import save_file

    from diffsynth_core.models.qwen_image import TRANSFORMER_CONFIGS

    folder = tmp_path_factory.mktemp("mem")
    config = dict(TRANSFORMER_CONFIGS["tiny"], num_layers=2, attention_head_dim=128, num_attention_heads=8,
                  joint_attention_dim=64, axes_dims_rope=(16, 56, 56))
    model = QwenImageTransformer2DModel.from_config(config).to(torch.bfloat16)  # stored as bf16, like releases
    model.save_pretrained(folder / "transformer")
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "dit.safetensors"))
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "QwenImagePipeline", "transformer": ["diffusers", "QwenImageTransformer2DModel"]}))
    return folder, sum(p.numel() * 2 for p in model.parameters())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("mode", ["folder", "file"])
def test_bf16_load_peaks_near_one_model_size(model_folder, mode):
    folder, model_bytes = model_folder
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    result = subprocess.run([sys.executable, "-c", CHILD, mode, str(folder)], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    peak = json.loads(result.stdout.strip().splitlines()[-1])["peak"]
    assert peak < 1.5 * model_bytes, f"peak {peak / 1e6:.0f} MB for a {model_bytes / 1e6:.0f} MB model"
