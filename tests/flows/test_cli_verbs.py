"""CLI verbs on a real config: status, preprocess --part, train/resume under Prefect, errors."""

import json

import pytest

from flows.cli import main
from stages.demo import demo_config, write_demo_dataset, write_demo_model


@pytest.fixture
def config_path(tmp_path):
    write_demo_dataset(tmp_path / "dataset")
    write_demo_model(tmp_path / "model")
    cfg = demo_config(tmp_path, overrides=["train.max_steps=4", "train.save_steps=2", "preprocess.parts=2"])
    return cfg.save(tmp_path / "config.toml")


def _json(out: str) -> dict:
    return json.loads(out[out.index("{"): out.rindex("}") + 1])


def test_status_then_one_part_then_resume_finishes_the_rest(config_path, capsys, prefect_harness):
    assert main(["status", str(config_path)]) == 0
    status = _json(capsys.readouterr().out)
    assert status["cache"]["exists"] is False and status["train"]["step"] == 0

    assert main(["preprocess", str(config_path), "--part", "0"]) == 0
    assert "8 encoded" in capsys.readouterr().out

    assert main(["resume", str(config_path)]) == 0
    result = _json(capsys.readouterr().out.split("\n", 1)[1])
    assert result["preprocess"]["encoded"] == 8 and result["preprocess"]["reused"] == 8
    assert result["train"]["steps"] == 4

    assert main(["status", str(config_path), "--set", "train.max_steps=4"]) == 0
    status = _json(capsys.readouterr().out)
    assert status["cache"]["complete"] is True and status["train"]["step"] == 4


def test_train_verb_with_diffsynth_flags_extends_a_finished_run(config_path, capsys, prefect_harness):
    assert main(["run", str(config_path)]) == 0
    capsys.readouterr()
    assert main(["train", str(config_path), "--set", "train.max_steps=6", "--learning_rate", "0.002"]) == 0
    result = _json(capsys.readouterr().out)["train"]
    assert result["resumed_from"] == 4 and result["steps"] == 6


def test_metadata_without_prompt_column_fails_with_the_file_named(tmp_path, capsys):
    write_demo_model(tmp_path / "model")
    (tmp_path / "meta.csv").write_text("image,caption_typo\na.png,x\n")
    cfg = demo_config(tmp_path, overrides=[f"dataset.metadata_path={tmp_path / 'meta.csv'}"])
    path = cfg.save(tmp_path / "config.toml")
    assert main(["preprocess", str(path), "--part", "0"]) == 2
    err = capsys.readouterr().err
    assert "meta.csv" in err and "prompt" in err
