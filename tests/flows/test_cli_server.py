"""The CLI path with its own Prefect server: first run, no-op run, signals, orphans, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.server import PIDFILE_PREFIX, _start_ticks, api_healthy, reap_orphans
from stages.demo import demo_config, write_demo_dataset, write_demo_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-assets")
    write_demo_dataset(root / "dataset")
    write_demo_model(root / "model")
    return root


def _config(assets: Path, workdir: Path, *overrides: str) -> Path:
    """A config whose output folder (and Prefect home inside it) does not exist yet."""
    cfg = demo_config(workdir, overrides=[f"dataset.base_path={assets / 'dataset'}", "train.save_steps=0",
                                          f"dataset.metadata_path={assets / 'dataset' / 'metadata.csv'}",
                                          f"model.path={assets / 'model'}", *overrides])
    workdir.mkdir(parents=True, exist_ok=True)
    return cfg.save(workdir / "run.toml")


def _env(tmp: Path) -> dict:
    """No Prefect server or home configured: the verb must start (and stop) its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    return {**env, "HOME": str(tmp)}


def _cli(*args: str, env: dict, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def _pidfile(home: Path, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in home.glob(f"{PIDFILE_PREFIX}*.json"):
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass  # being written
        time.sleep(0.1)
    raise TimeoutError(f"no server pidfile in {home}")


def _gone(pid: int, ticks: int | None, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _start_ticks(pid) != ticks:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def finished_run(assets, tmp_path_factory):
    """One `splitflow run` on a config whose output folder does not exist: the first-run case."""
    workdir = tmp_path_factory.mktemp("first-run")
    config = _config(assets, workdir / "fresh", "train.max_steps=2")
    run = _cli("run", str(config), env=_env(workdir))
    out, err = run.communicate(timeout=600)
    return config, workdir, run.returncode, out, err


def test_first_run_creates_its_output_and_leaves_no_server(finished_run):
    config, workdir, code, out, err = finished_run
    assert code == 0, err[-3000:]
    result = json.loads(out[out.index("{"):])
    assert result["preprocess"]["encoded"] == 16 and result["train"]["steps"] == 2
    home = config.parent / "output" / ".prefect"
    assert (home / "prefect.db").is_file() and not list(home.glob(f"{PIDFILE_PREFIX}*"))
    assert "Error logging to API" not in err and "Traceback" not in err


def test_run_with_nothing_left_answers_from_disk_without_prefect(finished_run):
    config, workdir, code, _, _ = finished_run
    assert code == 0
    server_log = config.parent / "output" / ".prefect" / "server.log"
    before = server_log.stat().st_size
    run = _cli("run", str(config), env=_env(workdir))
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    result = json.loads(out[out.index("{"):])
    assert "nothing left to do" in result["note"] and result["preprocess"]["reused"] == 16
    assert result["train"]["steps"] == 2 and result["train"]["exports"]
    assert server_log.stat().st_size == before  # no server was started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_run_leaves_no_server_behind(assets, tmp_path, sig):
    config = _config(assets, tmp_path / "killed", "train.max_steps=400")
    run = _cli("run", str(config), env=_env(tmp_path))
    try:
        server = _pidfile(config.parent / "output" / ".prefect")
        while not api_healthy(f"http://127.0.0.1:{server['port']}/api"):  # the verb is at work
            assert run.poll() is None, run.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        run.send_signal(sig)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert _gone(server["pid"], server["ticks"]), "the Prefect server outlived the verb"
    if sig == signal.SIGTERM:
        assert run.returncode == 130 and "interrupted; work written so far is kept" in err, err[-3000:]
        assert "Traceback" not in err


def test_next_start_stops_the_orphan_server_whose_verb_was_killed(tmp_path):
    """The pidfile path (where the kernel does not stop the server with its verb, e.g. macOS)."""
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    owner = subprocess.Popen([sys.executable, "-c", "pass"])
    live_owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        owner_ticks = _start_ticks(owner.pid)
        owner.wait()
        records = {"dead-owner": (orphan, owner.pid, owner_ticks), "live-owner": (other, live_owner.pid,
                                                                                  _start_ticks(live_owner.pid))}
        for port, (server, owner_pid, ticks) in records.items():
            (tmp_path / f"{PIDFILE_PREFIX}{port}.json").write_text(json.dumps(
                {"pid": server.pid, "ticks": _start_ticks(server.pid), "port": port, "owner": owner_pid,
                 "owner_ticks": ticks}))
        assert reap_orphans(tmp_path) == [orphan.pid]
        assert orphan.wait(timeout=10) is not None and other.poll() is None  # a live verb's server stays
        assert [p.name for p in tmp_path.iterdir()] == [f"{PIDFILE_PREFIX}live-owner.json"]
    finally:
        for process in (orphan, live_owner, other):
            process.kill()
            process.wait()


def test_a_bad_row_fails_once_at_once_in_one_line(assets, tmp_path):
    dataset = tmp_path / "dataset"
    write_demo_dataset(dataset)
    bad = (dataset / "metadata.csv").read_text().splitlines()[4].split(",")[0]  # data row 4 (index 3)
    (dataset / bad).write_bytes(b"not a png")
    config = _config(assets, tmp_path / "bad", f"dataset.base_path={dataset}", "preprocess.retries=3",
                     f"dataset.metadata_path={dataset / 'metadata.csv'}")
    run = _cli("run", str(config), env=_env(tmp_path))
    _, err = run.communicate(timeout=600)
    assert run.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Retry" not in err
    lines = [line for line in err.splitlines() if bad in line]
    assert len(lines) == 1 and lines[0].startswith("splitflow run: error:") and "index 3" in lines[0], err
