"""`splitflow deploy` against a real Prefect server with process workers on two work pools.

The parent deployment fans the preprocess parts out over the "cheap" pool, then trains on the
"big" pool; everything runs in real worker subprocesses on this machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cache_store import open_cache
from stages.demo import demo_config, write_demo_dataset, write_demo_model

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"Prefect server at {url} did not become healthy")


def _stop(proc: subprocess.Popen) -> None:
    """Workers need two signals (see ECOSYSTEM.md); the server stops on one."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def prefect_server(tmp_path):
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_WORKER_PREFETCH_SECONDS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", None)
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                               "--no-ui"], env=env, stdout=log, stderr=subprocess.STDOUT)
    procs = [server]
    try:
        _wait_healthy(env["PREFECT_API_URL"])
        yield env, procs
    finally:
        for proc in reversed(procs):
            _stop(proc)
        log.close()


def _prefect(env, *args, timeout=120):
    result = subprocess.run([BIN / "prefect", *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_deployments_run_the_stages_on_their_work_pools(prefect_server, tmp_path):
    env, procs = prefect_server
    write_demo_dataset(tmp_path / "dataset")
    write_demo_model(tmp_path / "model")
    cfg = demo_config(tmp_path, overrides=["train.max_steps=3", "train.save_steps=0", "preprocess.parts=2"])
    config_path = cfg.save(tmp_path / "config.toml")
    for pool in ("cheap-gpu", "big-gpu"):
        _prefect(env, "work-pool", "create", pool, "--type", "process")
    deployed = subprocess.run([BIN / "splitflow", "deploy", str(config_path), "--preprocess-pool", "cheap-gpu",
                               "--train-pool", "big-gpu"], env=env, capture_output=True, text=True, timeout=120)
    assert deployed.returncode == 0, deployed.stderr
    for pool in ("cheap-gpu", "big-gpu"):
        log = open(tmp_path / f"worker-{pool}.log", "w")
        procs.append(subprocess.Popen([BIN / "prefect", "worker", "start", "--pool", pool], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    out = _prefect(env, "deployment", "run", "split-training-pools/split-training-pools", "--watch",
                   "--watch-interval", "2", "--watch-timeout", "400", timeout=420)
    assert "Completed" in out, out + (tmp_path / "worker-big-gpu.log").read_text()[-3000:]

    assert len(open_cache(cfg.cache_url, mode="r").require_complete()) == 16
    assert (cfg.output_dir / "lora.safetensors").is_file()
    cheap_log = (tmp_path / "worker-cheap-gpu.log").read_text()
    big_log = (tmp_path / "worker-big-gpu.log").read_text()
    for part in ("preprocess-part0of2", "preprocess-part1of2"):  # each part ran on the cheap pool
        assert f"Flow run '{part}' - Finished in state Completed()" in cheap_log
    assert "Flow run 'train-qwen_image' - Finished in state Completed()" in big_log
    assert "preprocess-part" not in big_log
