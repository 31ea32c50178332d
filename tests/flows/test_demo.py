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
    assert [int(r["step"]) for r in rows] == list(range(1, 33))
    assert all(float(r["loss"]) > 0 for r in rows)
    with safe_open(str(output / "lora.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
        assert keys and all(k.startswith("transformer.") and ".lora_" in k for k in keys)
        lora_b = [handle.get_tensor(k) for k in keys if ".lora_B." in k]
    assert any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: it trained
    assert (output / "checkpoints" / "latest").read_text().strip() == "step-00000032"


def test_the_demo_teaches_its_loss_falls_and_its_validation_image_changes(demo_dir):
    """A newcomer sees learning: the mean loss of the last 6 steps is clearly below the first 6 (1.40 -> 1.08
    on the CPU), and the validation prompt renders differently after the second epoch than after the first."""
    import numpy as np
    from PIL import Image

    losses = [float(r["loss"]) for r in read_metrics(demo_dir / "output" / "metrics.csv")]
    first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
    assert last < 0.85 * first, (first, last)
    images = sorted((demo_dir / "output" / "validation").glob("step-*.png"))
    assert [p.name for p in images] == ["step-00000016-0.png", "step-00000032-0.png"]
    pixels = [np.asarray(Image.open(p), dtype=np.float64) for p in images]
    assert np.abs(pixels[1] - pixels[0]).mean() > 1.0  # of 255: not rounding noise


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
    out = capsys.readouterr().out
    # 16 rows, two entries each: the target's latents and its conditioning (docs/design.md, cache keys)
    assert "32 in 2 parts, plus 1 auxiliary: the empty prompt's embedding" in out
    assert main(["cache", "verify", str(demo_dir / "cache.zarr")]) == 0
    out = capsys.readouterr().out
    assert "0 bad, 0 missing: OK (32 entries + 1 auxiliary read)" in out  # the 33rd: the empty prompt


def test_resume_of_a_finished_demo_does_not_say_resuming(demo_dir, capsys):
    capsys.readouterr()
    assert main(["resume", str(demo_dir / "config.toml")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("nothing to resume: cache 16/16 entries, training at step 32")


def test_status_says_which_of_max_steps_and_num_epochs_decides(demo_dir, capsys):
    capsys.readouterr()
    assert main(["status", str(demo_dir / "config.toml")]) == 0  # 32 steps are the 2 epochs it names
    status = json.loads(capsys.readouterr().out)
    assert status["inputs"] == "ok" and "length" not in status and status["left"]["total_steps"] == 32
    assert main(["status", str(demo_dir / "config.toml"), "--set", "train.max_steps=24"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert "train.max_steps = 24 decides" in status["length"] and "about 1.5 epochs of 16 batches" in status["length"]
