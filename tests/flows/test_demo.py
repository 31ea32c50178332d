"""Issue 2's acceptance path: `splitflow demo` end to end under Prefect, twice."""

import json

import pytest
import torch
from safetensors import safe_open

from diffsynth_core.training.metrics import read_metrics
from flows.cli import main


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory, prefect_harness):
    workdir = tmp_path_factory.mktemp("demo")
    assert main(["demo", "--workdir", str(workdir)]) == 0
    return workdir


def test_demo_leaves_cache_config_metrics_and_a_diffusers_lora(demo_dir):
    output = demo_dir / "output"
    assert (demo_dir / "config.toml").is_file() and (output / "config.toml").is_file()
    assert (demo_dir / "cache.zarr").is_dir()
    rows = read_metrics(output / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 25))
    assert all(float(r["loss"]) > 0 for r in rows)
    with safe_open(str(output / "lora.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
        assert keys and all(k.startswith("transformer.") and ".lora_" in k for k in keys)
        lora_b = [handle.get_tensor(k) for k in keys if ".lora_B." in k]
    assert any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: it trained
    assert (output / "checkpoints" / "latest").read_text().strip() == "step-00000024"


def test_lora_loads_into_a_diffusers_pipeline_built_from_the_demo_model(demo_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(demo_dir / "model"))
    transformer = pipe.transformer
    torch.manual_seed(0)
    hidden = torch.randn(1, 36, transformer.config.in_channels)
    text = torch.randn(1, 5, transformer.config.joint_attention_dim)
    inputs = dict(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.tensor([0.5]),
                  img_shapes=[[(1, 6, 6)]], return_dict=False)
    with torch.no_grad():
        before = transformer(**inputs)[0]
        pipe.load_lora_weights(str(demo_dir / "output"), weight_name="lora.safetensors")
        after = transformer(**inputs)[0]
    assert not torch.allclose(before, after)


def test_second_demo_run_reencodes_nothing_and_says_so(demo_dir, capsys):
    capsys.readouterr()
    assert main(["demo", "--workdir", str(demo_dir)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{"): out.rindex("}") + 1])
    assert result["preprocess"]["encoded"] == 0 and result["preprocess"]["reused"] == 16
    assert result["preprocess"]["complete"] is True


def test_cache_inspect_and_verify_on_the_demo_cache(demo_dir, capsys):
    assert main(["cache", "inspect", str(demo_dir / "cache.zarr")]) == 0
    assert "16 in 2 parts" in capsys.readouterr().out
    assert main(["cache", "verify", str(demo_dir / "cache.zarr")]) == 0
    assert "0 bad, 0 missing: OK" in capsys.readouterr().out
