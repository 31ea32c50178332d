"""musubi-tuner's Wan2.2 A14B conventions (wan_train_network.py): ``--dit`` (low noise) with
``--dit_high_noise`` trains both experts in one run from Wan's released files, split at
``--timestep_boundary``; ``--min/--max_timestep`` cut the sigmas; a boundary outside (0, 1000) is
one line, exit 2.  I2V tasks take each clip's first frame as the image (wan_cache_latents.py ``--i2v``);
Wan2.1's i2v-14B needs ``--clip``."""

from __future__ import annotations

import pytest

from cache_store import open_cache
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


def _i2v_flags(root, **extra):
    """musubi's i2v-A14B flags on Wan2.2-I2V-A14B as released: --dit the low-noise DiT."""
    from tests.core.models.wan_released_layouts import MODEL_IDS

    base = root / "models" / MODEL_IDS["wan-i2v-a14b"]
    return {"task": "i2v-A14B", "dit": str(base / "low_noise_model/diffusion_pytorch_model.safetensors"),
            "t5": str(base / "models_t5_umt5-xxl-enc-bf16.pth"), "vae": str(base / "Wan2.1_VAE.pth"), **extra}, base


def test_i2v_a14b_trains_both_experts_on_each_clips_first_frame_from_a_musubi_dataset(released_models, tmp_path):
    """musubi's video dataset TOML (a folder of clips with captions) and --i2v convention: the first frame is
    the image, no column needed."""
    from tests.core.data.splitflow_media_files import write_mp4

    flags, base = _i2v_flags(released_models("wan-i2v-a14b"))
    flags["dit_high_noise"] = str(base / "high_noise_model/diffusion_pytorch_model.safetensors")
    (tmp_path / "videos").mkdir()
    write_mp4(tmp_path / "videos" / "clip.mp4", 9, 64, 64)
    (tmp_path / "videos" / "clip.txt").write_text("colours changing")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\n\n[[datasets]]\n'
                    f'video_directory = "{tmp_path / "videos"}"\ntarget_frames = [5]\n')
    overrides = wan_training_overrides(flags, base / "google" / "umt5-xxl") + [
        "model.path=''", f"dataset.metadata_path={toml}", "preprocess.parts=1", "train.max_steps=2",
        "train.save_steps=0"]
    cfg = demo_config(tmp_path, "wan", overrides)
    assert family_of(cfg).variant == "i2v-a14b"
    store = open_cache(preprocess.run(cfg).url, mode="r")
    entry = next(store.get(k) for k in store.keys() if "prompt_embeds" in store.get(k))
    assert entry["ref_latents_0"].shape == (16, 2, 8, 8) and entry["ref_latents_0"].float().std() > 0
    summary = train.run(cfg)
    assert {"diffusers_high_noise", "diffusers_low_noise"} <= set(summary.exports)


def test_one_i2v_a14b_dit_is_that_experts_run_and_wan21_i2v_needs_its_clip(released_models):
    flags, base = _i2v_flags(released_models("wan-i2v-a14b"), max_timestep="900")
    overrides = wan_training_overrides(flags)
    assert "model.variant='i2v-a14b-expert'" in overrides and "train.sigma_range=[0.0, 0.9]" in overrides
    flags["task"] = "i2v-14B"
    with pytest.raises(InputError, match="--task i2v-14B: --clip is missing"):
        wan_training_overrides(flags)
    clip = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    sources = next(o for o in wan_training_overrides({**flags, "clip": str(base / clip)}) if "sources" in o)
    assert f"image_encoder = [{str(base / clip)!r}]" in sources
