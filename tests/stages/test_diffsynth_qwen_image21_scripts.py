"""DiffSynth-Studio's Qwen-Image-2.1 LoRA script, read as `splitflow run <its flags>` reads it (in this process:
tests/stages/diffsynth_cli.py) on a tiny
Qwen-Image-2.1 laid out as DiffSynth keeps it (./models/Qwen/Qwen-Image-2.1/{transformer,text_encoder,vae,
processor}).

The flags are those of examples/qwen_image_21/model_training/lora/Qwen-Image-2.1.sh, unchanged: its
text-to-image command, and its edit block (commented out there: the Qwen-Image-Edit-2511 example dataset,
``--data_file_keys "image,edit_image" --extra_inputs "edit_image"``), each through both stages.  Flags appended at the end cut repeats,
epochs and sizes to fit CI (the last one wins, as with DiffSynth's argparse).  ``--lora_target_modules ""``
is DiffSynth's auto-detection, which at the released width takes every block Linear: the family's defaults.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from safetensors import safe_open

from diffsynth_core.models import get_family
from stages.demo import write_demo_dataset
from stages.demo_edit import write_edit_dataset

from .diffsynth_cli import run_script

MODELS = "Qwen/Qwen-Image-2.1:transformer/diffusion_pytorch_model*.safetensors,Qwen/Qwen-Image-2.1:text_encoder/" \
         "model*.safetensors,Qwen/Qwen-Image-2.1:vae/diffusion_pytorch_model{}.safetensors"
DATA = {"t2i": "data/diffsynth_example_dataset/qwen_image_21/Qwen-Image-2.1",
        "edit": "data/diffsynth_example_dataset/qwen_image/Qwen-Image-Edit-2511"}


def _script(task: str) -> list[str]:
    flags = ["--dataset_base_path", DATA[task]]
    if task == "t2i":
        flags += ["--dataset_metadata_path", f"{DATA[task]}/metadata.csv", "--max_pixels", "1048576",
                  "--dataset_repeat", "50", "--model_id_with_origin_paths", MODELS.format("*")]
    else:
        flags += ["--dataset_metadata_path", f"{DATA[task]}/metadata.json", "--data_file_keys", "image,edit_image",
                  "--extra_inputs", "edit_image", "--max_pixels", "1048576", "--dataset_repeat", "100",
                  "--model_id_with_origin_paths", MODELS.format("")]
    return flags + ["--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit.",
                    "--output_path", "./models/train/Qwen-Image-2.1_lora", "--lora_base_model", "dit",
                    "--lora_target_modules", "", "--lora_rank", "32", "--use_gradient_checkpointing",
                    "--find_unused_parameters"]


CUTS = ["--dataset_repeat", "1", "--num_epochs", "1", "--max_pixels", "4096"]
SMALL_REFERENCES = "dataset.reference_pixels=4096"


def _workdir(root: Path, tiny: Path, task: str) -> Path:
    release = root / "models/Qwen/Qwen-Image-2.1"
    release.mkdir(parents=True)
    for part in ("transformer", "text_encoder", "vae", "processor"):  # the tiny folders keep their config.json
        (release / part).symlink_to(tiny / part)
    if task == "t2i":
        write_demo_dataset(root / DATA[task], count=2)
    else:
        write_edit_dataset(root / DATA[task], count=2, name="metadata.json")
    return root


def test_diffsynth_qwen_image21_script_runs_unchanged(tmp_path, monkeypatch, capsys):
    """The script's text-to-image command, through both stages."""
    tiny = get_family("qwen_image21").save_tiny_model(tmp_path / "tiny", 0)
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    cwd = _workdir(tmp_path / "t2i", tiny, "t2i")
    monkeypatch.chdir(cwd)
    run_script([*_script("t2i"), *CUTS])
    assert capsys.readouterr().err.count("DiffSynth's auto-detection") == 1
    output = cwd / "models/train/Qwen-Image-2.1_lora"
    with safe_open(str(output / "lora.safetensors"), "pt") as handle:
        header = json.loads(handle.metadata()["lora_adapter_metadata"])
        modules = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in handle.keys()}
    assert header["transformer.r"] == 32 and header["transformer.lora_alpha"] == 32  # DiffSynth: alpha = rank
    assert {m for m in modules if m.startswith("transformer_blocks.0.")} == {f"transformer_blocks.0.{t}" for t in (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out")}
    config = tomllib.loads((output / "config.toml").read_text())
    assert config["model"]["family"] == "qwen_image21" and not config["model"]["path"]
    assert Path(config["model"]["sources"]["processor"][0]).samefile(tiny / "processor")
    assert len((output / "metrics.csv").read_text().splitlines()) == 3  # a header and one step per row


def test_the_scripts_edit_block_reads_rgba_references_the_vision_tower_sees_at_the_vae_size(tmp_path, monkeypatch):
    """The script's edit block (its flags, the Qwen-Image-Edit-2511 example dataset) as the config and dataset
    it becomes: Qwen-Image-2.1 from the files, each reference RGBA for the VAE and, for the vision tower, the
    same pixels over white."""
    from stages.common import family_of
    from stages.compat.diffsynth import run_config_from_cli
    from stages.datasets import open_dataset

    tiny = get_family("qwen_image21").save_tiny_model(tmp_path / "tiny", 0)
    monkeypatch.chdir(_workdir(tmp_path / "edit", tiny, "edit"))
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    cfg = run_config_from_cli(None, [SMALL_REFERENCES], _script("edit") + CUTS, "run")
    spec = family_of(cfg)
    assert spec.name == "qwen_image21" and set(cfg.model.sources) == {"transformer", "text_encoder", "vae", "processor"}
    sample = open_dataset(cfg.dataset, spec).load(0)
    assert sample.pixels.shape[0] == 4 and len(sample.references) == 1 and sample.references[0].shape[0] == 4
    reference, image = sample.references[0], sample.reference_images[0]
    assert image.mode == "RGB" and (image.height, image.width) == tuple(reference.shape[-2:])


def test_the_scripts_edit_block_runs_through_both_stages(tmp_path, monkeypatch):
    """The edit block run as `splitflow run` runs it: each cached row holds its reference latents and a prompt
    with one image slot per 2x2 of them, and the LoRA trains on every row (one step a row)."""
    from cache_store import open_cache

    tiny = get_family("qwen_image21").save_tiny_model(tmp_path / "tiny", 0)
    cwd = _workdir(tmp_path / "edit", tiny, "edit")
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    cfg, done = run_script([*_script("edit"), *CUTS, "--set", SMALL_REFERENCES])
    assert done["preprocess"].encoded == 2 and done["train"].steps == 2
    store = open_cache(cfg.cache_url, mode="r")
    rows = [key for key in store.keys() if "prompt_embeds" in store.shapes(key)]  # not the target latents' entries
    assert len(rows) == 2
    for key in rows:
        refs = store.shapes(key)["ref_latents_0"]
        assert int(store.get(key)["image_pad_mask"].sum()) == refs[-2] * refs[-1] // 4 > 0, key
    output = cwd / "models/train/Qwen-Image-2.1_lora"
    assert (output / "lora.safetensors").is_file()
    assert len((output / "metrics.csv").read_text().splitlines()) == 3
