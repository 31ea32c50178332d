"""What a newcomer meets first: input mistakes named before Prefect starts, in one line that says what to
do, with nothing left behind; help pages that list what can be set; cache verbs that agree."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

import flows.orchestrate
from flows.cli import main
from stages.demo import demo_config, write_demo_dataset, write_demo_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The demo's dataset and tiny model, written once; each test gets its own output and cache."""
    root = tmp_path_factory.mktemp("assets")
    write_demo_dataset(root / "dataset")
    write_demo_model(root / "model")
    return root


@pytest.fixture
def no_prefect(monkeypatch):
    """A tripwire: these mistakes must be reported before any Prefect session (server or API) starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("a Prefect session started before the input was checked")

    monkeypatch.setattr(flows.orchestrate, "prefect_session", refuse)


def _config(assets: Path, workdir: Path, *overrides: str) -> Path:
    cfg = demo_config(workdir, overrides=[f"dataset.base_path={assets / 'dataset'}",
                                          f"dataset.metadata_path={assets / 'dataset' / 'metadata.csv'}",
                                          f"model.path={assets / 'model'}", *overrides])
    return cfg.save(workdir / "config.toml")


def _nothing_written(workdir: Path) -> bool:
    return sorted(p.name for p in workdir.iterdir()) == ["config.toml"]


def test_missing_metadata_is_one_line_before_prefect_in_seconds_and_leaves_nothing(assets, tmp_path):
    """A fresh process (interpreter, imports and all) answers from disk: its CPU time is the check's cost
    on the demo config (wall time on a shared 2-core machine measures the neighbours)."""
    config = _config(assets, tmp_path, f"dataset.metadata_path={tmp_path / 'nothere.csv'}")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"before-Prefect check of the demo config: {cpu:.2f} s CPU, {wall:.2f} s wall")
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "dataset.metadata_path" in line and "nothere.csv" in line and "docs/datasets.md" in line
    assert cpu < 5.0
    assert _nothing_written(tmp_path)  # no cache.zarr/, no output/.prefect/


def test_a_missing_model_says_splitflow_never_downloads_and_where(assets, tmp_path, capsys, no_prefect):
    config = _config(assets, tmp_path, f"model.path={tmp_path / 'models' / 'Qwen-Image'}")
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and str(tmp_path / "models" / "Qwen-Image") in err
    assert "never downloads" in err and "--local-dir" in err and "docs/diffsynth.md" in err
    assert _nothing_written(tmp_path)


def test_the_tiny_demo_example_run_elsewhere_says_to_run_the_demo_first(tmp_path, monkeypatch, capsys, no_prefect):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(REPO / "examples" / "tiny_demo.toml")]) == 2
    err = capsys.readouterr().err
    assert "splitflow-demo" in err and "make demo" in err
    assert list(tmp_path.iterdir()) == []


def test_train_without_a_cache_says_to_preprocess_first(assets, tmp_path, capsys, no_prefect):
    config = _config(assets, tmp_path)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "cache.url" in err and "splitflow preprocess" in err
    assert _nothing_written(tmp_path)


def test_an_undecodable_image_names_skip_bad_samples_and_the_failed_first_run_leaves_nothing(
        assets, tmp_path, capsys, prefect_harness):
    """This one fails inside the preprocess flow (decoding is not a disk check): the run still takes away
    the output folder and the empty cache it created."""
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (64, 64), "red").save(data / "good.png")
    (data / "bad.png").write_bytes(b"not a png at all")
    (data / "metadata.csv").write_text("image,prompt\ngood.png,a red square\nbad.png,a broken file\n")
    config = _config(assets, tmp_path, f"dataset.base_path={data}", f"dataset.metadata_path={data / 'metadata.csv'}",
                     "preprocess.parts=1")
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "bad.png" in err and "dataset.skip_bad_samples" in err
    assert not (tmp_path / "output").exists() and not (tmp_path / "cache.zarr").exists()


def test_set_errors_blame_the_set_not_the_config_file(assets, tmp_path, capsys):
    config = _config(assets, tmp_path)
    assert main(["status", str(config), "--set", "train.learning_rate=fast"]) == 2
    err = capsys.readouterr().err
    assert "--set train.learning_rate=fast" in err and "invalid config" not in err and str(config) not in err


def test_cache_inspect_and_verify_agree_on_the_same_mistakes(assets, tmp_path, capsys):
    config = _config(assets, tmp_path)
    for action in ("inspect", "verify"):
        assert main(["cache", action, str(config)]) == 2  # a config where the cache belongs
        assert f"splitflow cache {action} {tmp_path / 'cache.zarr'}" in capsys.readouterr().err
        assert main(["cache", action, str(tmp_path / "nothing-here")]) == 2  # no cache at all


def test_help_lists_the_demo_families_and_the_diffsynth_flags(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    from diffsynth_core.models import known_families

    listed = capsys.readouterr().out
    assert all(family in listed for family in known_families())
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "DiffSynth-Studio" in out and "--dataset_base_path" in out and "docs/diffsynth.md" in out


def test_status_of_an_example_flags_its_missing_model_and_counts_no_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["status", str(REPO / "examples" / "qwen_image_lora.toml")]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["inputs"].startswith("model.path models/Qwen-Image is not a folder; splitflow never downloads")
    assert "left" not in status and status["train"]["step"] == 0  # no total_steps 0 beside max_steps


def test_status_before_preprocessing_says_when_steps_are_counted(assets, tmp_path, capsys):
    assert main(["status", str(_config(assets, tmp_path))]) == 0
    left = json.loads(capsys.readouterr().out)["left"]
    assert left["total_steps"] is None and "once every part is encoded" in left["note"]


def test_the_loss_status_shows_is_the_checkpoints_not_a_later_steps():
    """An interrupted run logged steps past its last checkpoint; resume trains them again."""
    from stages.status import _loss_at

    rows = [{"step": str(s), "loss": str(1.0 / s)} for s in range(1, 8)]  # metrics.csv rows up to step 7
    assert _loss_at(rows, 6) == 1.0 / 6 and _loss_at(rows, 0) is None
