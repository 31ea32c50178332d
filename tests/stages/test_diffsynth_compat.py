"""DiffSynth-Studio command lines become a RunConfig: flags mapped, no-ops noticed, bad input
reported at once in one line before any model or server starts; models found where DiffSynth keeps them."""

from __future__ import annotations

import time

import pytest

from flows.cli import main
from stages.compat.diffsynth import FLAGS, parse_flags, run_config_from_cli, split_argv
from stages.config import ConfigError

MODELS = {"qwen_image": "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,"
                        "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors",
          "wan": "Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors,"
                 "Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth"}


@pytest.fixture
def in_release(released_models, monkeypatch, capsys):
    """cwd = a folder whose ./models holds the family's release, as DiffSynth leaves it."""
    def enter(family):
        root = released_models(family)
        capsys.readouterr()  # a first build's library chatter is not the command's output
        monkeypatch.chdir(root)
        monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
        return root
    return enter


def test_flag_values_never_become_config_and_the_task_picks_the_verb():
    own, flags = split_argv(["run", "--dataset_base_path", "data/x", "--use_gradient_checkpointing",
                             "--lora_rank", "32", "--set", "train.seed=1", "--task", "sft:train"])
    assert own == ["train", "--set", "train.seed=1"]
    assert parse_flags(flags) == {"dataset_base_path": "data/x", "use_gradient_checkpointing": "true",
                                  "lora_rank": "32", "task": "sft:train"}
    assert split_argv(["--debug", "run", "cfg.toml", "--task=sft:data_process"])[0] == ["--debug", "preprocess", "cfg.toml"]


def test_every_unknown_flag_is_reported_in_one_line_before_anything_starts(capsys):
    started = time.perf_counter()
    assert main(["run", "--dataset_base_pth", "x", "--lora_rnk", "4", "--lora_rank"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--dataset_base_pth" in err and "--lora_rnk" in err and "--lora_rank (needs a value)" in err
    assert time.perf_counter() - started < 5  # no server, no model


def test_refused_flags_are_all_named_at_once(capsys):
    assert main(["train", "--fp8_models", "dit", "--task", "direct_distill", "--enable_wandb_log",
                 "--preset_lora_model", "dit"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--fp8_models" in err and "direct_distill" in err
    assert "--enable_wandb_log" in err and "preset_lora_model" not in err  # its default is harmless


def test_config_file_keeps_its_values_and_flags_override(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(f'[model]\npath = "{tmp_path}"\n[train]\nlora_rank = 8\n')
    cfg = run_config_from_cli(str(path), [], ["--data_file_keys", "video", "--dataset_num_workers", "8",
                                              "--learning_rate", "2e-4"], "status")
    assert cfg.dataset.data_file_keys == ["video"] and cfg.train.learning_rate == 2e-4
    assert cfg.train.lora_rank == 8 and cfg.output.path == "./splitflow-out"  # not DiffSynth's defaults
    assert capsys.readouterr().err.count("--dataset_num_workers has no effect") == 1


def test_without_config_diffsynth_defaults_hold_and_the_family_comes_from_the_files(in_release, capsys):
    in_release("wan")
    cfg = run_config_from_cli(None, [], ["--model_id_with_origin_paths", MODELS["wan"], "--dataset_base_path", "d",
                                         "--dataset_metadata_path", "d/m.csv", "--trainable_models", "dit",
                                         "--lora_base_model", "dit"], "preprocess")
    assert cfg.model.family == "wan" and cfg.dataset.num_frames == 81 and cfg.train.lora_rank == 32
    assert cfg.output.path == "./models" and cfg.dataset.max_pixels == 1024 * 1024
    assert cfg.train.gradient_checkpointing is True  # Wan's train.py forces it
    assert cfg.train.lora_target_modules == ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    assert set(cfg.model.sources) == {"transformer", "text_encoder", "vae", "tokenizer"}
    assert "only the LoRA trains" in capsys.readouterr().err


def test_trainable_models_dit_alone_is_full_fine_tuning(in_release):
    in_release("qwen_image")
    cfg = run_config_from_cli(None, [], ["--model_id_with_origin_paths", MODELS["qwen_image"].split(",")[0],
                                         "--dataset_base_path", "d", "--dataset_metadata_path", "m.csv",
                                         "--trainable_models", "dit"], "train")
    assert cfg.train.trainable_models == ["transformer"] and cfg.train.lora_rank == 0
    assert set(cfg.model.sources) == {"transformer"}  # train-only: no tokenizer needed


def test_lora_flags_beside_full_fine_tuning_are_ignored_as_diffsynth_does(in_release, capsys):
    in_release("qwen_image")
    cfg = run_config_from_cli(None, [], ["--model_id_with_origin_paths", MODELS["qwen_image"].split(",")[0],
                                         "--dataset_base_path", "d", "--dataset_metadata_path", "m.csv",
                                         "--trainable_models", "dit", "--lora_alpha", "16",
                                         "--lora_target_modules", "to_q,to_k"], "train")
    assert cfg.train.lora_rank == 0 and cfg.train.lora_alpha is None and cfg.train.lora_target_modules is None
    assert "--lora_alpha and --lora_target_modules ignored" in capsys.readouterr().err


def test_bad_lora_targets_are_named_together_before_training(in_release, capsys):
    in_release("qwen_image")
    started = time.perf_counter()
    assert main(["run", "--model_id_with_origin_paths", MODELS["qwen_image"], "--dataset_base_path", "d",
                 "--dataset_metadata_path", "m.csv", "--lora_base_model", "dit",
                 "--lora_target_modules", "to_q,a_to_qkv,nonsense"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "['a_to_qkv', 'nonsense'] match no Linear module" in err[0]
    assert time.perf_counter() - started < 20


def test_a_missing_download_names_the_folder_and_how_to_fetch_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFSYNTH_MODEL_BASE_PATH", str(tmp_path / "elsewhere"))
    assert main(["run", "--model_id_with_origin_paths", MODELS["wan"], "--dataset_base_path", "d",
                 "--dataset_metadata_path", "m.csv"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "elsewhere" / "Wan-AI/Wan2.1-T2V-1.3B") in err and "modelscope download" in err


def test_model_paths_json_and_base_path_override(released_models, tmp_path, monkeypatch):
    root = released_models("wan")
    monkeypatch.chdir(tmp_path)
    base = root / "models" / "Wan-AI/Wan2.1-T2V-1.3B"
    cfg = run_config_from_cli(None, [], [
        "--model_paths", f'["{base}/diffusion_pytorch_model.safetensors", ["{base}/Wan2.1_VAE.pth"]]',
        "--model_base_path", str(root / "models"), "--tokenizer_path", str(base / "google/umt5-xxl"),
        "--dataset_base_path", "d", "--dataset_metadata_path", "m.csv"], "status")
    assert set(cfg.model.sources) == {"transformer", "vae", "tokenizer"}
    assert cfg.model.sources["tokenizer"] == [str((base / "google/umt5-xxl").resolve())]


def test_files_of_two_families_are_refused(released_models, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    qwen = released_models("qwen_image") / "models/Qwen/Qwen-Image/transformer"
    wan = released_models("wan") / "models/Wan-AI/Wan2.1-T2V-1.3B/Wan2.1_VAE.pth"
    with pytest.raises(ConfigError, match="do not belong to one family"):
        run_config_from_cli(None, [], ["--model_paths", f'["{qwen}", "{wan}"]', "--dataset_metadata_path", "m"],
                            "status")


def test_sft_train_trains_on_what_sft_data_process_wrote(in_release, tmp_path):
    """DiffSynth's split training: step 2 names the DiT and step 1's output folder; the dataset and
    encoders that made the cache come from the preprocess.toml step 1 left there."""
    in_release("qwen_image")
    step1 = run_config_from_cli(None, [], ["--model_id_with_origin_paths", MODELS["qwen_image"].split(",", 1)[1],
                                           "--dataset_base_path", "data", "--dataset_metadata_path", "data/m.csv",
                                           "--output_path", str(tmp_path / "cache"), "--task", "sft:data_process"],
                                "run")
    (tmp_path / "cache" / "cache.zarr").mkdir(parents=True)
    step1.save(tmp_path / "cache" / "preprocess.toml")  # what preprocess's finalize writes
    step2 = ["--dataset_base_path", str(tmp_path / "cache"), "--task", "sft:train", "--dataset_repeat", "50",
             "--model_id_with_origin_paths", MODELS["qwen_image"].split(",")[0], "--lora_base_model", "dit",
             "--lora_target_modules", "to_q"]
    cfg = run_config_from_cli(None, [], step2, "run")
    assert cfg.cache.url == str((tmp_path / "cache" / "cache.zarr").resolve())
    assert cfg.dataset.metadata_path == "data/m.csv" and cfg.dataset.repeat == 50
    assert set(cfg.model.sources) == {"transformer", "text_encoder", "vae", "tokenizer"}
    (tmp_path / "cache" / "preprocess.toml").unlink()
    with pytest.raises(ConfigError, match="no preprocess.toml"):
        run_config_from_cli(None, [], step2, "train")
    (tmp_path / "ds" / "0").mkdir(parents=True)
    (tmp_path / "ds" / "0" / "0.pth").write_bytes(b"")
    with pytest.raises(ConfigError, match="splitflow cache import"):
        run_config_from_cli(None, [], ["--dataset_base_path", str(tmp_path / "ds"), "--task", "sft:train",
                                       "--model_id_with_origin_paths", MODELS["qwen_image"].split(",")[0]], "train")


def test_the_flag_table_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "diffsynth.md").read_text()
    missing = [name for name in FLAGS if f"`--{name}`" not in doc and not name.startswith("dmd2_")]
    assert not missing


def test_deploy_without_a_config_file_says_what_to_do(capsys):
    assert main(["deploy", "--dataset_base_path", "d"]) == 2
    assert "registers a CONFIG file" in capsys.readouterr().err


def test_a_diffsynth_command_line_leaves_epoch_files_where_diffsynth_writes_them(preprocessed_demo, tmp_path):
    """DiffSynth's ModelLogger writes <output_path>/epoch-K.safetensors and its validate.py loads that name:
    the run leaves the DiffSynth-format export there (tests/core/models/test_lora_consumers.py loads that
    format with DiffSynth's own key conventions)."""
    from stages.compat.diffsynth import run_config_from_cli as config_of

    out = tmp_path / "models"
    assert main(["train", str(preprocessed_demo / "config.toml"), "--in-process", "--output_path", str(out),
                 "--num_epochs", "1", "--set", "train.max_steps=16", "--set", "train.save_steps=0"]) == 0
    cfg = config_of(str(preprocessed_demo / "config.toml"), [], ["--output_path", str(out)], "train")
    assert cfg.output.diffsynth_files
    assert (out / "epoch-0.safetensors").read_bytes() == (out / "loras" / "epoch-0_diffsynth.safetensors").read_bytes()
    assert not list(out.glob(".epoch-0.safetensors.tmp-*"))
    plain = tmp_path / "plain"
    assert main(["train", str(preprocessed_demo / "config.toml"), "--in-process", "--set", f"output.path={plain}",
                 "--set", "train.max_steps=16", "--set", "train.save_steps=0"]) == 0
    assert not (plain / "epoch-0.safetensors").exists()  # a splitflow config keeps its own layout
