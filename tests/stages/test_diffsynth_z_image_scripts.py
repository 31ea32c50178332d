"""DiffSynth-Studio's Z-Image LoRA scripts, read as `splitflow run <their flags>` reads them (in this process:
tests/stages/diffsynth_cli.py) on a tiny Z-Image laid out as DiffSynth keeps it (./models/Tongyi-MAI/Z-Image-Turbo/..., ./models/Tongyi-MAI/Z-Image/
transformer/..., weights without config.json).

The flags are those of examples/z_image/model_training/lora/Z-Image.sh and Z-Image-Turbo.sh, unchanged;
flags appended at the end cut repeats, epochs and sizes to fit CI (the last one wins, as with DiffSynth's
argparse).  The variant comes from the
transformer's model id: Turbo's run logs the reference's recommendation for a distilled model, base's does not.
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path

from safetensors import safe_open

from stages.demo import write_demo_dataset

from .diffsynth_cli import run_script


def _script(variant: str) -> list[str]:
    name = {"base": "Z-Image", "turbo": "Z-Image-Turbo"}[variant]
    return [
        "--dataset_base_path", f"data/diffsynth_example_dataset/z_image/{name}",
        "--dataset_metadata_path", f"data/diffsynth_example_dataset/z_image/{name}/metadata.csv",
        "--max_pixels", "1048576", "--dataset_repeat", "50",
        "--model_id_with_origin_paths", f"Tongyi-MAI/{name}:transformer/*.safetensors,"
        "Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors",
        "--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
        "--output_path", f"./models/train/{name}_lora", "--lora_base_model", "dit",
        "--lora_target_modules", "to_q,to_k,to_v,to_out.0,w1,w2,w3", "--lora_rank", "32",
        "--use_gradient_checkpointing", "--dataset_num_workers", "8"]


CUTS = ["--dataset_repeat", "1", "--num_epochs", "1", "--max_pixels", "4096"]
EXPECTED = {f"layers.0.{m}" for m in ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                                      "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
NOTICE = "Z-Image-Turbo is distilled"


def _workdir(release: Path, root: Path, script: list[str]) -> Path:
    root.mkdir()
    (root / "models").mkdir()
    for entry in (release / "models").iterdir():
        (root / "models" / entry.name).symlink_to(entry)
    write_demo_dataset(root / script[1], count=2)
    return root


def test_diffsynth_z_image_scripts_run_unchanged(released_models, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    for variant in ("base", "turbo"):
        script = _script(variant)
        cwd = _workdir(released_models("z_image"), tmp_path / variant, script)
        monkeypatch.chdir(cwd)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            run_script([*script, *CUTS])
        err = capsys.readouterr().err
        for flag in ("remove_prefix_in_ckpt", "dataset_num_workers"):
            assert err.count(f"--{flag} has no effect here") == 1, (variant, flag)
        assert caplog.text.count(NOTICE) == (1 if variant == "turbo" else 0), variant
        output = cwd / script[script.index("--output_path") + 1]
        with safe_open(str(output / "lora.safetensors"), "pt") as handle:
            modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in handle.keys()}
            header = json.loads(handle.metadata()["lora_adapter_metadata"])
        assert header["transformer.r"] == 32 and header["transformer.lora_alpha"] == 32  # DiffSynth: alpha = rank
        assert {m for m in modules if m.startswith("layers.0.")} == EXPECTED, variant
        assert {m.split(".")[0] for m in modules} == {"layers", "noise_refiner", "context_refiner"}
        config = tomllib.loads((output / "config.toml").read_text())
        assert config["model"]["family"] == "z_image" and not config["model"]["path"]
        transformer = config["model"]["sources"]["transformer"]
        assert all(f"/Tongyi-MAI/{'Z-Image-Turbo' if variant == 'turbo' else 'Z-Image'}/" in p for p in transformer)
