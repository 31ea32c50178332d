"""One run per folder: a second train of an output folder, or writer of a cache part, is refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from diffsynth_core.errors import EXIT_ENVIRONMENT, LockHeldError
from diffsynth_core.training.metrics import read_metrics
from stages import preprocess, train
from stages.locks import OUTPUT_LOCK, cache_part_lock
from tests.stages.metadata import keep_rows


def _cli_train(config_path) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", str(config_path), "--in-process"]


def test_a_second_train_is_refused_naming_the_first_and_a_sigkilled_first_is_taken_over(make_config, tmp_path):
    cfg = make_config("train.max_steps=100000", "train.save_steps=0")
    keep_rows(cfg, 2)
    preprocess.run(cfg)
    config_path = cfg.save(tmp_path / "config.toml")
    first = subprocess.Popen(_cli_train(config_path), cwd=os.getcwd(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        metrics = cfg.output_dir / "metrics.csv"
        deadline = time.time() + 120
        while not (metrics.exists() and metrics.stat().st_size > 60) and time.time() < deadline:
            assert first.poll() is None, "the first training stopped"
            time.sleep(0.1)
        second = subprocess.run(_cli_train(config_path), cwd=os.getcwd(), capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == EXIT_ENVIRONMENT, second.stderr
        [line] = [text for text in second.stderr.splitlines() if text.startswith("splitflow")]
        assert f"is in use by pid {first.pid} on {socket.gethostname()} since 20" in line
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the holder was not disturbed
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps = [int(row["step"]) for row in read_metrics(metrics)]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no step logged twice

    # its holder is dead: the next training takes the folder over at once
    assert str(first.pid) in (cfg.output_dir / OUTPUT_LOCK).read_text()  # the dead holder's record
    assert train.run(make_config("train.max_steps=2")).steps == 2


def test_a_second_writer_of_a_cache_part_is_refused_naming_the_holder(make_config):
    cfg = make_config("preprocess.parts=2")
    read, write = os.pipe()
    holder = os.fork()
    if holder == 0:  # pragma: no cover - the other writer, in its own process
        try:
            with cache_part_lock(cfg, "part-0-of-2"):
                os.write(write, b"held")
                while True:
                    time.sleep(0.1)
        finally:
            os._exit(1)
    try:
        assert os.read(read, 16) == b"held"
        with pytest.raises(LockHeldError, match=f"cache part part-0-of-2 of .* is in use by pid {holder} "):
            preprocess.run(cfg, 0)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
