"""DiffSynth-Studio's example LoRA scripts, run as `python -m flows.cli run <their flags>` on tiny
models laid out as DiffSynth keeps them (./models/<model_id>/..., original file and key names).

The flags are those of DiffSynth-Studio's examples/qwen_image/model_training/lora/Qwen-Image.sh,
examples/flux/model_training/lora/FLUX.1-dev.sh and examples/wanvideo/model_training/lora/Wan2.1-T2V-1.3B.sh,
unchanged; flags appended at the end cut repeats, epochs and sizes to fit CI (the last one wins, as
with DiffSynth's argparse).  The three runs share one Prefect server and run side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from safetensors import safe_open

from stages.demo import write_demo_dataset
from tests.core.data.splitflow_media_files import write_metadata, write_mp4

REPO = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "qwen_image": [
        "--dataset_base_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image",
        "--dataset_metadata_path", "data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv",
        "--max_pixels", "1048576", "--dataset_repeat", "50",
        "--model_id_with_origin_paths", "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,"
        "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors",
        "--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
        "--output_path", "./models/train/Qwen-Image_lora", "--lora_base_model", "dit",
        "--lora_target_modules", "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,"
        "img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1",
        "--lora_rank", "32", "--use_gradient_checkpointing", "--dataset_num_workers", "8", "--find_unused_parameters"],
    "flux": [
        "--dataset_base_path", "data/diffsynth_example_dataset/flux/FLUX.1-dev",
        "--dataset_metadata_path", "data/diffsynth_example_dataset/flux/FLUX.1-dev/metadata.csv",
        "--max_pixels", "1048576", "--dataset_repeat", "50",
        "--model_id_with_origin_paths", "black-forest-labs/FLUX.1-dev:flux1-dev.safetensors,"
        "black-forest-labs/FLUX.1-dev:text_encoder/model.safetensors,black-forest-labs/FLUX.1-dev:text_encoder_2/*.safetensors,"
        "black-forest-labs/FLUX.1-dev:ae.safetensors",
        "--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
        "--output_path", "./models/train/FLUX.1-dev_lora", "--lora_base_model", "dit",
        "--lora_target_modules", "a_to_qkv,b_to_qkv,ff_a.0,ff_a.2,ff_b.0,ff_b.2,a_to_out,b_to_out,proj_out,norm.linear,"
        "norm1_a.linear,norm1_b.linear,to_qkv_mlp",
        "--lora_rank", "32", "--align_to_opensource_format", "--use_gradient_checkpointing"],
    "wan": [
        "--dataset_base_path", "data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B",
        "--dataset_metadata_path", "data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B/metadata.csv",
        "--height", "480", "--width", "832", "--dataset_repeat", "100",
        "--model_id_with_origin_paths", "Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors,"
        "Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth",
        "--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
        "--output_path", "./models/train/Wan2.1-T2V-1.3B_lora", "--lora_base_model", "dit",
        "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", "32"],
}
CUTS = {"qwen_image": ["--dataset_repeat", "1", "--num_epochs", "1", "--max_pixels", "4096"],
        "flux": ["--dataset_repeat", "1", "--num_epochs", "1", "--max_pixels", "4096"],
        "wan": ["--height", "64", "--width", "64", "--num_frames", "5", "--dataset_repeat", "1", "--num_epochs", "1"]}
NO_OPS = {"qwen_image": ["remove_prefix_in_ckpt", "dataset_num_workers", "find_unused_parameters"],
          "flux": ["remove_prefix_in_ckpt", "align_to_opensource_format"], "wan": ["remove_prefix_in_ckpt"]}
# The LoRA modules each script must train, in diffusers names (block 0; DiffSynth's names translated).
EXPECTED = {
    "qwen_image": {f"transformer_blocks.0.{m}" for m in (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
        "attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1")},
    "flux": {f"transformer_blocks.0.{m}" for m in (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "ff.net.0.proj",
        "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "attn.to_out.0", "attn.to_add_out", "norm1.linear",
        "norm1_context.linear")} | {f"single_transformer_blocks.0.{m}" for m in (
        "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out", "norm.linear")},
    "wan": {f"blocks.0.{a}.{m}" for a in ("attn1", "attn2") for m in ("to_q", "to_k", "to_v", "to_out.0")}
           | {"blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2"},
}


def _workdir(family: str, release: Path, root: Path) -> Path:
    """cwd of a DiffSynth user: ./models (the downloads) and ./data (the example dataset's layout)."""
    root.mkdir()
    (root / "models").mkdir()
    for entry in (release / "models").iterdir():
        (root / "models" / entry.name).symlink_to(entry)
    data = root / SCRIPTS[family][1]
    if family == "wan":
        data.mkdir(parents=True)
        write_mp4(data / "video1.mp4", 9, 64, 64)
        write_metadata(data / "metadata.csv", [{"video": "video1.mp4", "prompt": "colours changing"}])
    else:
        write_demo_dataset(data, count=2)
    return root


def _lora_modules(path: Path) -> tuple[set[str], dict]:
    with safe_open(str(path), "pt") as handle:
        modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in handle.keys()}
        header = json.loads(handle.metadata()["lora_adapter_metadata"])
    return modules, header


def test_diffsynth_example_scripts_run_unchanged(released_models, tmp_path, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PYTHONPATH=str(REPO), PREFECT_API_URL=PREFECT_API_URL.value(), HF_HUB_OFFLINE="1")
    env.pop("DIFFSYNTH_MODEL_BASE_PATH", None)
    runs = {}
    for family in SCRIPTS:
        cwd = _workdir(family, released_models(family), tmp_path / family)
        command = [sys.executable, "-m", "flows.cli", "run", *SCRIPTS[family], *CUTS[family]]
        runs[family] = (cwd, subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
    for family, (cwd, process) in runs.items():
        try:
            out, err = process.communicate(timeout=600)
        finally:
            process.kill()
        assert process.returncode == 0, f"{family}: {err[-3000:]}"
        for flag in NO_OPS[family]:
            assert err.count(f"--{flag} has no effect here") == 1, (family, flag)
        output = cwd / SCRIPTS[family][SCRIPTS[family].index("--output_path") + 1]
        modules, header = _lora_modules(output / "lora.safetensors")
        assert header["transformer.r"] == 32 and header["transformer.lora_alpha"] == 32  # DiffSynth: alpha = rank
        assert {m for m in modules if m.split(".")[1] == "0"} == EXPECTED[family], family
        config = tomllib.loads((output / "config.toml").read_text())
        assert config["model"]["family"] == family and not config["model"]["path"]
        assert "transformer" in config["model"]["sources"]
    assert "proj_out" not in _lora_modules(tmp_path / "flux/models/train/FLUX.1-dev_lora/lora.safetensors")[0]
