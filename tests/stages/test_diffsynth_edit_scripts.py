"""DiffSynth-Studio's Qwen-Image-Edit LoRA scripts, read as `splitflow run <their flags>` reads them (in this
process: tests/stages/diffsynth_cli.py) on tiny edit models laid out as DiffSynth keeps them: the edit DiT under ``./models/Qwen/Qwen-Image-Edit*/``,
the text encoder, VAE and tokenizer under ``./models/Qwen/Qwen-Image/``, the processor under
``./models/Qwen/Qwen-Image-Edit/processor/`` (DiffSynth's train.py default for every edit model).

The flags are those of examples/qwen_image/model_training/lora/Qwen-Image-Edit.sh, Qwen-Image-Edit-2509.sh
and Qwen-Image-Edit-2511.sh, unchanged; flags appended at the end cut repeats, epochs and sizes to fit
CI (the last one wins, as with DiffSynth's argparse).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from safetensors import safe_open

from diffsynth_core.models import get_family
from stages.demo_edit import write_edit_dataset

from .diffsynth_cli import run_script

RELEASES = {"Qwen-Image-Edit": "edit", "Qwen-Image-Edit-2509": "edit-2509", "Qwen-Image-Edit-2511": "edit-2511"}
METADATA = {"Qwen-Image-Edit": "metadata.csv", "Qwen-Image-Edit-2509": "metadata.json",
            "Qwen-Image-Edit-2511": "metadata.json"}


def _script(release: str) -> list[str]:
    data = f"data/diffsynth_example_dataset/qwen_image/{release}"
    flags = [
        "--dataset_base_path", data, "--dataset_metadata_path", f"{data}/{METADATA[release]}",
        "--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image",
        "--max_pixels", "1048576", "--dataset_repeat", "50",
        "--model_id_with_origin_paths", f"Qwen/{release}:transformer/diffusion_pytorch_model*.safetensors,"
        "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors",
        "--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
        "--output_path", f"./models/train/{release}_lora", "--lora_base_model", "dit",
        "--lora_target_modules", "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,"
        "img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1",
        "--lora_rank", "32", "--use_gradient_checkpointing", "--dataset_num_workers", "8", "--find_unused_parameters"]
    if release == "Qwen-Image-Edit-2511":
        flags.append("--zero_cond_t")
    return flags


CUTS = ["--dataset_repeat", "1", "--num_epochs", "1", "--max_pixels", "4096", "--set", "dataset.reference_pixels=4096"]


def _models(root: Path, tiny: dict[str, Path]) -> None:
    """./models as DiffSynth downloads the releases (weights without config.json are read from shapes;
    the tiny folders keep theirs, which the loaders read when it lies beside the weights)."""
    qwen = root / "models/Qwen"
    for release, variant in RELEASES.items():
        (qwen / release).mkdir(parents=True)
        (qwen / release / "transformer").symlink_to(tiny[variant] / "transformer")
    (qwen / "Qwen-Image-Edit/processor").symlink_to(tiny["edit"] / "processor")
    (qwen / "Qwen-Image").mkdir()
    for part in ("text_encoder", "vae", "tokenizer"):
        (qwen / "Qwen-Image" / part).symlink_to(tiny["edit"] / part)


def test_diffsynth_edit_scripts_run_unchanged(tmp_path, monkeypatch):
    tiny = {v: get_family("qwen_image", v).save_tiny_model(tmp_path / "tiny" / v, 0) for v in RELEASES.values()}
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    for release in RELEASES:
        cwd = tmp_path / release
        _models(cwd, tiny)
        write_edit_dataset(cwd / f"data/diffsynth_example_dataset/qwen_image/{release}", count=2,
                           as_list=release != "Qwen-Image-Edit", name=METADATA[release])
        monkeypatch.chdir(cwd)
        run_script([*_script(release), *CUTS])
        output = cwd / f"models/train/{release}_lora"
        with safe_open(str(output / "lora.safetensors"), "pt") as handle:
            header = json.loads(handle.metadata()["lora_adapter_metadata"])
            assert any(".img_mod.1." in k for k in handle.keys())
        assert header["transformer.r"] == 32
        config = tomllib.loads((output / "config.toml").read_text())
        assert config["model"]["family"] == "qwen_image" and not config["model"]["path"]
        assert config["model"].get("variant") in (None, RELEASES[release])
        assert Path(config["model"]["sources"]["processor"][0]).samefile(tiny["edit"] / "processor")
        assert (config["model"].get("zero_cond_t") is True) == (release == "Qwen-Image-Edit-2511")
