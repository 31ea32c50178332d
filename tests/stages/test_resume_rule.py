"""One resume rule for every setting (stages/resume_rule.py), tried as users fail: a run killed with SIGKILL or
finished, then the same output run again with a setting changed, a LoRA added or rows added to the metadata."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diffsynth_core.training.metrics import read_metrics
from flows.cli import main
from stages import preprocess, train
from stages.resume_rule import RULES, Kind, config_keys

from .metadata import keep_rows, rewrite_metadata
from .one_line import assert_one_line, cli
from .sigkill import train_until_first_checkpoint
from .test_train import _overrides

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_has_exactly_one_resume_rule_and_the_docs_list_it():
    assert sorted(RULES) == sorted(config_keys())
    table = (ROOT / "docs" / "trust.md").read_text()
    assert [key for key in RULES if f"`{key}`" not in table] == []


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stages.resume_rule"]


def test_a_changed_learning_rate_and_weight_decay_take_effect_from_the_resumed_step(make_config, tmp_path, caplog):
    steps = ["train.max_steps=12", "train.save_steps=4"]
    cfg = make_config(*steps)
    keep_rows(cfg, 3)
    preprocess.run(cfg)
    killed_at = train_until_first_checkpoint(tmp_path, _overrides(cfg, *steps), cfg.output_dir)
    assert 4 <= killed_at < 12, killed_at
    lr_only = tmp_path / "lr-only"
    shutil.copytree(cfg.output_dir, lr_only)  # the same killed output, resumed with the learning rate alone changed

    with caplog.at_level(logging.INFO):
        summary = train.run(make_config(*steps, "train.learning_rate=3e-4", "train.weight_decay=0.5"))
    assert summary.resumed_from == killed_at and summary.steps == 12
    lrs = [float(row["lr"]) for row in read_metrics(cfg.output_dir / "metrics.csv")]
    old = cfg.train.learning_rate
    assert old != 3e-4 and lrs == [old] * killed_at + [3e-4] * (12 - killed_at)  # the old value no longer wins
    notices = _notices(caplog)
    assert len(notices) == 1, notices
    assert f"train.learning_rate {old!r} -> 0.0003" in notices[0] and "train.weight_decay 0.01 -> 0.5" in notices[0]
    assert f"in effect from step {killed_at + 1}" in notices[0]

    train.run(make_config(*steps, "train.learning_rate=3e-4", f"output.path={lr_only}"))
    with_decay = load_file(str(cfg.output_dir / "lora.safetensors"))
    without = load_file(str(lr_only / "lora.safetensors"))
    assert any(not with_decay[k].equal(without[k]) for k in with_decay)  # the new weight decay stepped too


@pytest.fixture(scope="module")
def trained(preprocessed_demo, tmp_path_factory) -> tuple[Path, Path]:
    """(config, output) of a LoRA run finished at step 2 over the shared preprocessed demo."""
    out = tmp_path_factory.mktemp("trained") / "out"
    assert main(["train", str(preprocessed_demo / "config.toml"), "--in-process", "--set", f"output.path={out}",
                 "--set", "train.max_steps=2"]) == 0
    return preprocessed_demo / "config.toml", out


@pytest.fixture
def copied(trained, tmp_path) -> tuple[Path, Path]:
    """The finished output copied for one test (a run may change it)."""
    config, out = trained
    shutil.copytree(out, tmp_path / "out")
    return config, tmp_path / "out"


def _no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(train, "load_transformer", refuse)


FIXED = {  # each: the override, then the checkpoint's value and the config's as the line names them
    "train.lora_rank=8": "train.lora_rank was 4, this config sets 8",
    "train.lora_alpha=4": "train.lora_alpha was None, this config sets 4.0",
    "train.lora_init='default'": "train.lora_init was 'gaussian', this config sets 'default'",
    "train.lora_target_modules=['to_q']": "train.lora_target_modules was None, this config sets ['to_q']",
    "train.optimizer='torch.optim.SGD'": "train.optimizer was 'torch.optim.AdamW', this config sets 'torch.optim.SGD'",
    "offload.storage_dtype='bfloat16'": "offload.storage_dtype was None, this config sets 'bfloat16'",
    "train.batch_size=2": "train.batch_size was 1, this config sets 2",
}


@pytest.mark.parametrize("override", list(FIXED))
def test_a_setting_that_may_not_change_is_refused_before_any_model_loads(copied, capsys, monkeypatch, override):
    config, out = copied
    _no_model_loads(monkeypatch)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    code, err = cli(capsys, "train", config, "--in-process", "--set", f"output.path={out}",
                    "--set", "train.max_steps=4", "--set", override)
    assert_one_line(code, err, 2, "cannot resume checkpoint", "step-00000002", FIXED[override],
                    "set them back to continue, or set output.path to another folder")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_run_refuses_it_before_prefect_starts_so_nothing_is_retried(copied, capsys, monkeypatch):
    config, out = copied
    import flows.orchestrate

    def no_prefect(*args, **kwargs):
        raise AssertionError("Prefect was started")

    monkeypatch.setattr(flows.orchestrate, "prefect_session", no_prefect)
    code, err = cli(capsys, "run", config, "--set", f"output.path={out}", "--set", "train.max_steps=4",
                    "--set", "train.lora_rank=8")
    assert_one_line(code, err, 2, "train.lora_rank was 4, this config sets 8")


@pytest.mark.parametrize("argv, fragments", [
    (["--set", "train.learning_rate=3e-4"], ["train.learning_rate 0.02 -> 0.0003"]),
    # DiffSynth-Studio flags, whose users expect every command to start fresh
    (["--learning_rate", "3e-4"], ["train.learning_rate 0.02 -> 0.0003"]),
    (["--num_epochs", "3"], ["train.num_epochs 2 -> 3"]),
], ids=["--set", "--learning_rate", "--num_epochs"])
def test_a_finished_output_given_another_config_says_how_to_continue_and_how_to_start_anew(copied, capsys, argv,
                                                                                           fragments):
    config, out = copied
    code, err = cli(capsys, "run", config, "--set", f"output.path={out}", "--set", "train.max_steps=2", *argv)
    assert_one_line(code, err, 2, f"output {out} finished training at step 2", *fragments,
                    "raise train.max_steps (or train.num_epochs)", "set output.path to another folder")


def test_a_lora_checkpoint_added_on_a_finished_output_is_refused(copied, capsys, trained):
    config, out = copied
    code, err = cli(capsys, "run", config, "--set", f"output.path={out}", "--set", "train.max_steps=2",
                    "--lora_checkpoint", trained[1] / "lora.safetensors")
    assert_one_line(code, err, 2, "train.lora_checkpoint was None, this config sets", "lora.safetensors",
                    "set output.path to another folder to start anew")


def test_the_same_config_on_a_finished_output_has_nothing_left_to_do(copied, capsys):
    config, out = copied
    code, err = cli(capsys, "run", config, "--set", f"output.path={out}", "--set", "train.max_steps=2")
    assert code == 0 and "nothing left to do" in capsys.out, err


def test_fewer_steps_than_the_checkpoint_holds_are_refused(copied, capsys):
    config, out = copied
    code, err = cli(capsys, "train", config, "--in-process", "--set", f"output.path={out}", "--set",
                    "train.max_steps=1")
    assert_one_line(code, err, 2, "is at step 2, past the 1 steps this config plans", "raise train.max_steps")


def test_a_dataset_that_grew_is_named_with_counts(make_config, caplog):
    cfg = make_config("train.max_steps=2")
    rows = []
    rewrite_metadata(cfg, lambda all_rows: rows.extend(all_rows) or all_rows[:2])
    preprocess.run(cfg)
    train.run(cfg)
    rewrite_metadata(cfg, lambda _: rows[:3])  # a row added to the metadata before the re-run
    grown = make_config("train.max_steps=2")
    preprocess.run(grown)
    with pytest.raises(train.InputError, match="finished training at step 2.*the dataset grew from 2 to 3 samples "
                                               r"\(1 added\).*raise train.max_steps"):
        train.run(grown)
    with caplog.at_level(logging.INFO):
        summary = train.run(make_config("train.max_steps=3"))
    assert summary.resumed_from == 2 and summary.steps == 3
    notices = _notices(caplog)
    assert len(notices) == 1 and "the dataset grew from 2 to 3 samples (1 added)" in notices[0], notices


def test_the_table_sorts_settings_into_the_classes_the_docs_name():
    refused = {key for key, kind in RULES.items() if kind is Kind.FIXED}
    assert {"train.lora_rank", "train.lora_alpha", "train.lora_init", "train.lora_target_modules", "model.family",
            "model.variant", "train.trainable_models", "train.optimizer", "offload.storage_dtype"} <= refused
    assert {"train.learning_rate", "train.weight_decay", "train.warmup_steps", "train.save_steps",
            "output.export_every"}.isdisjoint(refused)
