"""DiffSynth-Studio's image-to-video Wan scripts read unchanged (only the launcher replaced), on tiny models laid
out as DiffSynth downloads them (tests/core/models/wan_released_layouts.py):

* examples/wanvideo/model_training/lora/Wan2.2-TI2V-5B.sh: the Wan2.2 VAE and the 48-channel DiT, trained
  image-to-video from each clip's first frame (``--extra_inputs input_image``) and, without that flag,
  text-to-video;
* lora/Wan2.2-I2V-A14B.sh, both halves: each expert's 36-channel DiT on its ``--max/--min_timestep_boundary``;
* lora/Wan2.1-I2V-14B-480P.sh: the I2V DiT with Wan's CLIP (``models_clip_...vit-huge-14.pth``);
* special/split_training/Wan2.1-I2V-14B-480P.sh: ``--task sft:data_process``, then ``sft:train`` on its cache.

Preprocess and train run in process (as tests/stages/test_diffsynth_a14b.py does), 5-frame 64x64 clips, 2 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from cache_store import open_cache
from diffsynth_core.errors import InputError
from diffsynth_core.training.flow_matching import diffsynth_sigmas
from stages import preprocess, train
from stages.common import family_of
from stages.compat.diffsynth import run_config_from_cli
from tests.core.data.splitflow_media_files import write_metadata, write_mp4
from tests.core.models.wan_released_layouts import CLIP_FILE, MODEL_IDS

TI2V, I2V_A14B, I2V = (MODEL_IDS[r] for r in ("wan-ti2v-5b", "wan-i2v-a14b", "wan-i2v-14b"))
T5, VAE21 = "models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"


def _common(name: str, frames: list[str]) -> list[str]:
    data = f"data/diffsynth_example_dataset/wanvideo/{name}"
    return ["--dataset_base_path", data, "--dataset_metadata_path", f"{data}/metadata.csv", "--height", "480",
            "--width", "832", *frames, "--dataset_repeat", "100"]


def _lora(output: str) -> list[str]:
    return ["--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
            "--output_path", f"./models/train/{output}", "--lora_base_model", "dit",
            "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", "32"]


def _ti2v() -> list[str]:
    """lora/Wan2.2-TI2V-5B.sh, flag for flag."""
    models = f"{TI2V}:diffusion_pytorch_model*.safetensors,{TI2V}:{T5},{TI2V}:Wan2.2_VAE.pth"
    return (_common("Wan2.2-TI2V-5B", ["--num_frames", "49"]) + ["--model_id_with_origin_paths", models]
            + _lora("Wan2.2-TI2V-5B_lora") + ["--extra_inputs", "input_image"])


def _i2v_a14b(expert: str, high: str, low: str) -> list[str]:
    """One half of lora/Wan2.2-I2V-A14B.sh."""
    models = f"{I2V_A14B}:{expert}_noise_model/diffusion_pytorch_model*.safetensors,{I2V_A14B}:{T5},{I2V_A14B}:{VAE21}"
    return (_common("Wan2.2-I2V-A14B", ["--num_frames", "49"]) + ["--model_id_with_origin_paths", models]
            + _lora(f"Wan2.2-I2V-A14B_{expert}_noise_lora")
            + ["--extra_inputs", "input_image", "--max_timestep_boundary", high, "--min_timestep_boundary", low])


I2V_MODELS = f"{I2V}:diffusion_pytorch_model*.safetensors,{I2V}:{T5},{I2V}:{VAE21},{I2V}:{CLIP_FILE}"


def _i2v() -> list[str]:
    """lora/Wan2.1-I2V-14B-480P.sh (no --num_frames: DiffSynth's 81)."""
    return (_common("Wan2.1-I2V-14B-480P", []) + ["--model_id_with_origin_paths", I2V_MODELS]
            + _lora("Wan2.1-I2V-14B-480P_lora") + ["--extra_inputs", "input_image"])


CUTS = ["--height", "64", "--width", "64", "--num_frames", "5", "--dataset_repeat", "1", "--num_epochs", "1"]
BOUNDARY = int(0.358 * 1000)  # the grid index DiffSynth's loss.py draws below (high noise) or from (low noise)
# script -> (its flags, the release it reads, the variant its files are, the conditioning entries it caches)
SCRIPTS = {
    "TI2V-5B": (_ti2v(), "wan-ti2v-5b", "ti2v-5b", {"ref_latents_0": (48, 1, 4, 4)}),
    "TI2V-5B text-to-video": (_ti2v()[:-2], "wan-ti2v-5b", "ti2v-5b", {}),
    "I2V-A14B high": (_i2v_a14b("high", "0.358", "0"), "wan-i2v-a14b", "i2v-a14b-expert",
                      {"ref_latents_0": (16, 2, 8, 8), "ref_mask_0": (4, 2, 8, 8)}),
    "I2V-A14B low": (_i2v_a14b("low", "1", "0.358"), "wan-i2v-a14b", "i2v-a14b-expert",
                     {"ref_latents_0": (16, 2, 8, 8), "ref_mask_0": (4, 2, 8, 8)}),
    "Wan2.1-I2V-14B": (_i2v(), "wan-i2v-14b", "i2v",
                       {"ref_latents_0": (16, 2, 8, 8), "ref_mask_0": (4, 2, 8, 8), "image_embeds": (17, 80)}),
}


@pytest.fixture
def diffsynth_cwd(released_models, tmp_path, monkeypatch):
    """A DiffSynth user's cwd for one release: ./models (the release, and DiffSynth's default tokenizer
    folder Wan-AI/Wan2.1-T2V-1.3B:google/umt5-xxl/) and ./data with one 9-frame clip in each example folder."""
    def make(release: str):
        source = released_models(release) / "models" / MODEL_IDS[release]
        (tmp_path / "models" / MODEL_IDS[release]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / MODEL_IDS[release]).symlink_to(source)
        tokenizer = tmp_path / "models/Wan-AI/Wan2.1-T2V-1.3B/google"
        tokenizer.mkdir(parents=True)
        (tokenizer / "umt5-xxl").symlink_to(source / "google" / "umt5-xxl")
        for name in ("Wan2.2-TI2V-5B", "Wan2.2-I2V-A14B", "Wan2.1-I2V-14B-480P"):
            data = tmp_path / "data/diffsynth_example_dataset/wanvideo" / name
            data.mkdir(parents=True)
            write_mp4(data / "video1.mp4", 9, 64, 64)
            write_metadata(data / "metadata.csv", [{"video": "video1.mp4", "prompt": "colours changing"}])
        return tmp_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    return make


def _entry(cfg) -> dict:
    store = open_cache(preprocess.run(cfg).url, mode="r")
    return next(store.get(key) for key in store.keys() if "prompt_embeds" in store.get(key))


def _trained_lora(path: str) -> set[str]:
    """The modules the LoRA file trained (their lora_B moved off its zero start)."""
    with safe_open(path, "pt") as handle:
        return {k.rsplit(".lora_B", 1)[0] for k in handle.keys() if ".lora_B" in k and handle.get_tensor(k).any()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_wan_image_to_video_scripts_train_from_their_files_as_released(script, diffsynth_cwd):
    flags, release, variant, conditioning = SCRIPTS[script]
    diffsynth_cwd(release)
    cfg = run_config_from_cli(None, ["train.max_steps=2"], flags + CUTS, "run")
    assert cfg.model.family == "wan" and family_of(cfg).variant == variant
    entry = _entry(cfg)
    assert {k: tuple(entry[k].shape) for k in conditioning} == conditioning
    assert not {"ref_latents_0", "image_embeds"} & set(entry) - set(conditioning)
    for name in conditioning:
        assert entry[name].float().std() > 0, name  # encoded from the frame, not zeros
    summary = train.run(cfg)
    assert summary.steps == 2
    assert "transformer.blocks.0.attn1.to_q" in _trained_lora(summary.exports["diffusers"])
    if "--max_timestep_boundary" in flags:  # an A14B half: its expert's DiT, on the grid points DiffSynth draws
        high = "high" in script
        assert ("high_noise_model" if high else "low_noise_model") in cfg.model.sources["transformer"][0]
        grid, (low_sigma, high_sigma) = diffsynth_sigmas("Wan"), cfg.train.sigma_range
        points = grid[:BOUNDARY] if high else grid[BOUNDARY:]
        assert grid[(grid >= low_sigma) & (grid <= high_sigma)].tolist() == points.tolist()
        with safe_open(summary.exports["diffusers"], "pt") as handle:
            assert handle.metadata()["splitflow_sigma_range"] == f"[{low_sigma}, {high_sigma}]"


SPLIT_CACHE = "./models/train/Wan2.1-I2V-14B-480P_lora_split_cache"


def _split(task: str) -> list[str]:
    """One step of special/split_training/Wan2.1-I2V-14B-480P.sh, flag for flag."""
    if task == "sft:data_process":
        data = _common("Wan2.1-I2V-14B-480P", [])[:-1] + ["1"]  # this step's --dataset_repeat 1
        output, offload = SPLIT_CACHE, f"{I2V}:diffusion_pytorch_model*.safetensors"
    else:
        data = ["--dataset_base_path", SPLIT_CACHE, "--height", "480", "--width", "832", "--dataset_repeat", "100"]
        output, offload = SPLIT_CACHE.removesuffix("_cache"), f"{I2V}:{T5},{I2V}:{VAE21},{I2V}:{CLIP_FILE}"
    return (data + ["--model_id_with_origin_paths", I2V_MODELS] + _lora(output.split("/")[-1])
            + ["--extra_inputs", "input_image", "--task", task, "--offload_models", offload])


def test_split_training_script_trains_from_the_cache_its_first_step_wrote(diffsynth_cwd):
    diffsynth_cwd("wan-i2v-14b")
    step1 = run_config_from_cli(None, [], _split("sft:data_process") + CUTS, "run")
    entry = _entry(step1)
    assert {"ref_latents_0", "ref_mask_0", "image_embeds"} <= set(entry)
    step2 = run_config_from_cli(None, ["train.max_steps=2"], _split("sft:train") + CUTS[4:], "run")
    assert Path(step2.cache.url) == (Path(SPLIT_CACHE) / "cache.zarr").resolve()  # no second encoding
    assert step2.dataset.first_frame_reference and family_of(step2).variant == "i2v"
    summary = train.run(step2)
    assert summary.steps == 2 and "transformer.blocks.1.ffn.net.2" in _trained_lora(summary.exports["diffusers"])


def test_an_image_to_video_row_whose_image_is_missing_is_one_line_naming_row_and_file(diffsynth_cwd):
    root = diffsynth_cwd("wan-i2v-a14b")
    write_metadata(root / "data/diffsynth_example_dataset/wanvideo/Wan2.2-I2V-A14B/metadata.csv",
                   [{"video": "video1.mp4", "prompt": "colours changing", "cond_image": "first.png"}])
    cfg = run_config_from_cli(None, [], _i2v_a14b("high", "0.358", "0") + CUTS, "run")
    with pytest.raises(InputError, match=r"row 1 \(index 0\), file .*first.png: column 'cond_image'") as error:
        preprocess.run(cfg)
    assert "\n" not in str(error.value)
