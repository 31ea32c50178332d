"""DiffSynth-Studio's examples/wanvideo/model_training/lora/Wan2.2-T2V-A14B.sh, both halves, read unchanged:
each expert's DiT file (Wan's release names, under high_noise_model/ or low_noise_model/) with its
``--max/--min_timestep_boundary`` becomes a run drawing exactly DiffSynth's grid points of that
expert; preprocess and train run in process on tiny models (the Prefect-run scripts are
tests/flows/test_diffsynth_scripts.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open

from stages import preprocess, train
from stages.compat.diffsynth import run_config_from_cli
from diffsynth_core.errors import InputError
from diffsynth_core.training.flow_matching import diffsynth_sigmas
from tests.core.data.splitflow_media_files import write_metadata, write_mp4

A14B = "Wan-AI/Wan2.2-T2V-A14B"
DATA = "data/diffsynth_example_dataset/wanvideo/Wan2.2-T2V-A14B"


def _script(expert: str, high: str, low: str) -> list[str]:
    """One half of Wan2.2-T2V-A14B.sh, flag for flag."""
    return [
        "--dataset_base_path", DATA, "--dataset_metadata_path", f"{DATA}/metadata.csv",
        "--height", "480", "--width", "832", "--num_frames", "49", "--dataset_repeat", "100",
        "--model_id_with_origin_paths", f"{A14B}:{expert}/diffusion_pytorch_model*.safetensors,"
        f"{A14B}:models_t5_umt5-xxl-enc-bf16.pth,{A14B}:Wan2.1_VAE.pth",
        "--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
        "--output_path", f"./models/train/Wan2.2-T2V-A14B_{expert.split('_')[0]}_noise_lora", "--lora_base_model", "dit",
        "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", "32",
        "--max_timestep_boundary", high, "--min_timestep_boundary", low]


CUTS = ["--height", "64", "--width", "64", "--num_frames", "5", "--dataset_repeat", "1", "--num_epochs", "1"]


@pytest.fixture
def diffsynth_cwd(released_models, tmp_path, monkeypatch):
    """./models as DiffSynth downloads Wan2.2-T2V-A14B (each expert a Wan-named DiT; the tokenizer in its
    default Wan2.1 folder) and ./data with one clip."""
    release = released_models("wan") / "models" / "Wan-AI" / "Wan2.1-T2V-1.3B"
    base = tmp_path / "models" / A14B
    for expert in ("high_noise_model", "low_noise_model"):
        (base / expert).mkdir(parents=True)
        shutil.copy(release / "diffusion_pytorch_model.safetensors", base / expert)  # tiny; its own path
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"):
        (base / name).symlink_to(release / name)
    (tmp_path / "models" / "Wan-AI" / "Wan2.1-T2V-1.3B").symlink_to(release)
    data = tmp_path / DATA
    data.mkdir(parents=True)
    write_mp4(data / "video1.mp4", 9, 64, 64)
    write_metadata(data / "metadata.csv", [{"video": "video1.mp4", "prompt": "colours changing"}])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    return tmp_path


def test_each_half_of_the_a14b_script_trains_its_expert_on_diffsynths_grid_points(diffsynth_cwd):
    grid = diffsynth_sigmas("Wan")
    halves = {"high": ("high_noise_model", "0.417", "0", grid[:417]),
              "low": ("low_noise_model", "1", "0.417", grid[417:])}
    for name, (expert, high, low, points) in halves.items():
        cfg = run_config_from_cli(None, ["train.max_steps=2"], _script(expert, high, low) + CUTS, "train")
        assert cfg.model.family == "wan" and expert in cfg.model.sources["transformer"][0]
        low_sigma, high_sigma = cfg.train.sigma_range
        inside = grid[(grid >= low_sigma) & (grid <= high_sigma)]
        assert torch.equal(inside, points), name  # the very points DiffSynth's randint draws
        preprocess.run(cfg)
        summary = train.run(cfg)
        assert summary.steps == 2
        with safe_open(summary.exports["diffusers"], "pt") as handle:
            assert handle.metadata()["splitflow_sigma_range"] == f"[{low_sigma}, {high_sigma}]"
    # the high-noise expert's LoRA continued in a low-noise run: refused (one line, exit 2)
    high_lora = diffsynth_cwd / "models/train/Wan2.2-T2V-A14B_high_noise_lora/lora.safetensors"
    cfg = run_config_from_cli(None, [f"train.lora_checkpoint={high_lora}", "output.path=other"],
                              _script("low_noise_model", "1", "0.417") + CUTS, "train")
    with pytest.raises(InputError, match="another expert"):
        train.run(cfg)


@pytest.mark.parametrize("high, low", [("1.2", "0"), ("0.4", "0.5"), ("0.5", "-0.1")])
def test_a_boundary_outside_0_1_is_refused_naming_the_flags(diffsynth_cwd, high, low):
    from stages.config import ConfigError

    with pytest.raises(ConfigError, match="--min_timestep_boundary .* each must lie in \\[0, 1\\]"):
        run_config_from_cli(None, [], _script("high_noise_model", high, low) + CUTS, "train")
