"""musubi-tuner's Wan2.2 A14B conventions (wan_train_network.py): ``--dit`` (low noise) with
``--dit_high_noise`` trains both experts in one run from Wan's released files, split at
``--timestep_boundary``; ``--min/--max_timestep`` cut the sigmas; a boundary outside (0, 1000) is
one line, exit 2."""

from __future__ import annotations

import pytest

from diffsynth_core.errors import InputError
from stages import preprocess, train
from stages.compat.musubi import wan_training_overrides
from stages.demo import demo_config
from stages.demo_video import write_demo_video_dataset
from stages.train import trained_experts
from stages.common import family_of


def _flags(release, **extra):
    base = release / "models" / "Wan-AI" / "Wan2.1-T2V-1.3B"
    dit = str(base / "diffusion_pytorch_model.safetensors")
    return {"task": "t2v-A14B", "dit": dit, "dit_high_noise": dit, "t5": str(base / "models_t5_umt5-xxl-enc-bf16.pth"),
            "vae": str(base / "Wan2.1_VAE.pth"), **extra}, base / "google" / "umt5-xxl"


def test_dit_high_noise_trains_both_experts_at_the_given_boundary(released_models, tmp_path):
    flags, tokenizer = _flags(released_models("wan"), timestep_boundary="900")
    write_demo_video_dataset(tmp_path / "dataset")
    overrides = wan_training_overrides(flags, tokenizer) + [
        "model.path=''", "dataset.num_frames=5", "preprocess.parts=1",
        "train.max_steps=2", "train.save_steps=0"]
    cfg = demo_config(tmp_path, "wan", overrides)
    spec, experts, sigma_range = trained_experts(cfg, family_of(cfg))
    assert [(e.component, e.sigma_min, e.sigma_max) for e in experts] == [
        ("transformer", 0.9, 1.0), ("transformer_2", 0.0, 0.9)] and sigma_range == (0.0, 1.0)
    preprocess.run(cfg)
    summary = train.run(cfg)
    assert {"diffusers_high_noise", "diffusers_low_noise"} <= set(summary.exports)


def test_one_dit_with_a_timestep_range_is_that_experts_run(released_models):
    flags, _ = _flags(released_models("wan"), min_timestep="0", max_timestep="875")
    del flags["dit_high_noise"]
    overrides = wan_training_overrides(flags)
    assert "model.variant='t2v'" in overrides and "train.sigma_range=[0.0, 0.875]" in overrides


@pytest.mark.parametrize("boundary", ["1000", "0", "1500", "-3"])
def test_a_boundary_outside_0_1000_is_refused(released_models, boundary):
    flags, _ = _flags(released_models("wan"), timestep_boundary=boundary)
    with pytest.raises(InputError, match="--timestep_boundary .*must lie inside \\(0, 1000\\)"):
        wan_training_overrides(flags)
