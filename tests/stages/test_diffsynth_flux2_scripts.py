"""DiffSynth-Studio's FLUX.2 LoRA scripts, read as `splitflow run <their flags>` reads them (in this process:
tests/stages/diffsynth_cli.py) on tiny FLUX.2 models
laid out as DiffSynth keeps them (./models/black-forest-labs/FLUX.2-dev/..., weights without config.json, DiTs
with the releases' block counts, since the scripts name every single block's attn.to_out).

The flags are those of examples/flux2/model_training/lora/FLUX.2-klein-4B.sh, FLUX.2-klein-base-9B.sh and
FLUX.2-dev.sh, unchanged; flags appended at the end cut repeats, epochs and sizes to fit CI (the last one wins,
as with DiffSynth's argparse).  FLUX.2-dev.sh is a split run: its first command (`--task sft:data_process`)
names only the encoders, Mistral tells the variant; its second trains from that cache.  All three run through
both stages; FLUX.2-klein-base-9B.sh is also checked as `splitflow run` resolves it (family, variant, sources
from two releases, its 24 single blocks' targets on the DiT).  The variants come from the model ids: klein-4B's
run logs the reference's recommendation for a distilled model, the base and dev runs do not.
"""

from __future__ import annotations

import logging
import tomllib

from tests.flows.test_diffsynth_scripts import _lora_modules

from .diffsynth_cli import run_script
from .test_diffsynth_z_image_scripts import _workdir

BFL = "black-forest-labs"
TARGETS = "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,to_qkv_mlp_proj"
DEV_TARGETS = "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_qkv_mlp_proj,to_out.0,to_add_out,linear_in,linear_out"


def _single_outs(count: int) -> str:
    return ",".join(f"single_transformer_blocks.{i}.attn.to_out" for i in range(count))


def _klein(name: str, encoders: str, singles: int) -> list[str]:
    """FLUX.2-klein-4B.sh and FLUX.2-klein-base-9B.sh (their transformer from ``name``, the rest from ``encoders``)."""
    return [
        "--dataset_base_path", f"data/diffsynth_example_dataset/flux2/{name}",
        "--dataset_metadata_path", f"data/diffsynth_example_dataset/flux2/{name}/metadata.csv",
        "--max_pixels", "1048576", "--dataset_repeat", "50",
        "--model_id_with_origin_paths", f"{BFL}/{encoders}:text_encoder/*.safetensors,{BFL}/{name}:transformer/"
        f"*.safetensors,{BFL}/{encoders}:vae/diffusion_pytorch_model.safetensors",
        "--tokenizer_path", f"{BFL}/{encoders}:tokenizer/", "--learning_rate", "1e-4", "--num_epochs", "5",
        "--remove_prefix_in_ckpt", "pipe.dit.", "--output_path", f"./models/train/{name}_lora",
        "--lora_base_model", "dit", "--lora_target_modules", f"{TARGETS},{_single_outs(singles)}",
        "--lora_rank", "32", "--use_gradient_checkpointing"]


def _dev(task: str) -> list[str]:
    """FLUX.2-dev.sh's two commands: the encoders into a cache, then the DiT from it."""
    first = task == "sft:data_process"
    data = ["--dataset_base_path", "data/diffsynth_example_dataset/flux2/FLUX.2-dev", "--dataset_metadata_path",
            "data/diffsynth_example_dataset/flux2/FLUX.2-dev/metadata.csv"] if first else \
        ["--dataset_base_path", "./models/train/FLUX.2-dev-LoRA-splited-cache"]
    models = (f"{BFL}/FLUX.2-dev:text_encoder/*.safetensors,{BFL}/FLUX.2-dev:vae/diffusion_pytorch_model.safetensors"
              if first else f"{BFL}/FLUX.2-dev:transformer/*.safetensors")
    return [*data, "--max_pixels", "1048576", "--dataset_repeat", "1" if first else "50",
            "--model_id_with_origin_paths", models, "--learning_rate", "1e-4", "--num_epochs", "5",
            "--remove_prefix_in_ckpt", "pipe.dit.",
            "--output_path", "./models/train/FLUX.2-dev-LoRA-splited" + ("-cache" if first else ""),
            "--lora_base_model", "dit", "--lora_target_modules", f"{DEV_TARGETS},{_single_outs(48)}",
            "--lora_rank", "32", "--use_gradient_checkpointing", "--dataset_num_workers", "8", "--task", task]


BASE_9B = _klein("FLUX.2-klein-base-9B", "FLUX.2-klein-9B", 24)
SCRIPTS = {"klein-4b": [_klein("FLUX.2-klein-4B", "FLUX.2-klein-4B", 20)], "klein-base-9b": [BASE_9B],
           "dev": [_dev("sft:data_process"), _dev("sft:train")]}
CUTS = ["--dataset_repeat", "1", "--num_epochs", "1", "--max_pixels", "4096"]
NOTICE = "is step-distilled"
BLOCK_MODULES = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                 "ff_context.linear_out"}


def _resolved_in_process(cwd: Path, monkeypatch) -> None:
    """FLUX.2-klein-base-9B.sh as `splitflow run` reads it, up to the checks made before training starts."""
    from stages.common import check_lora_targets, family_of
    from stages.compat.diffsynth import run_config_from_cli, split_argv

    monkeypatch.chdir(cwd)
    _, flags = split_argv(["run", *BASE_9B, *CUTS])
    cfg = run_config_from_cli(None, [], flags, "run")
    spec = family_of(cfg)
    assert spec.variant == "klein-base-9b" and "training_notice" not in spec.extras
    sources = cfg.model.sources
    assert all(f"/{BFL}/FLUX.2-klein-base-9B/transformer/" in p for p in sources["transformer"])
    assert all(f"/{BFL}/FLUX.2-klein-9B/" in p for name in ("text_encoder", "vae", "tokenizer") for p in sources[name])
    check_lora_targets(cfg, spec)  # single_transformer_blocks.0-23.attn.to_out are the 9B DiT's


def test_diffsynth_flux2_scripts_run_unchanged(released_models, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    for variant, commands in SCRIPTS.items():
        cwd = _workdir(released_models("flux2"), tmp_path / variant, commands[0])
        if variant == "klein-base-9b":  # its sources come from two releases
            _resolved_in_process(cwd, monkeypatch)
        monkeypatch.chdir(cwd)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for flags in commands:  # a split run's second command reads the first's cache
                run_script([*flags, *CUTS])
        assert caplog.text.count(NOTICE) == (1 if variant == "klein-4b" else 0), variant
        output = cwd / commands[-1][commands[-1].index("--output_path") + 1]
        modules, header = _lora_modules(output / "lora.safetensors")
        assert header["transformer.r"] == 32 and header["transformer.lora_alpha"] == 32  # DiffSynth: alpha = rank
        singles = {m for m in modules if m.startswith("single_transformer_blocks.")}
        assert {m.split(".", 2)[2] for m in singles} == {"attn.to_qkv_mlp_proj", "attn.to_out"}, variant
        assert {m.removeprefix("transformer_blocks.0.") for m in modules
                if m.startswith("transformer_blocks.0.")} == BLOCK_MODULES, variant
        config = tomllib.loads((output / "config.toml").read_text())
        assert config["model"]["family"] == "flux2" and not config["model"]["path"]
        release = {"klein-4b": "FLUX.2-klein-4B", "klein-base-9b": "FLUX.2-klein-base-9B", "dev": "FLUX.2-dev"}
        assert all(f"/{BFL}/{release[variant]}/" in p for p in config["model"]["sources"]["transformer"])
