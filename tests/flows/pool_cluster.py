"""A real Prefect deployment on this machine: ``prefect server start`` and process workers.

Used by test_pools.py (one cluster per module).  Every process started here is stopped in
``close``, also when a test fails; workers get two signals (ECOSYSTEM.md), a lost node is
simulated by SIGKILLing a worker together with the flow-run processes it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from flows.server import _free_port, api_healthy

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (via /proc): the flow-run processes a worker started."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "PREFECT_API_URL": self.url,
                    "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1"}
        self.server: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.others: list[subprocess.Popen] = []

    # -- server ------------------------------------------------------------------------------------
    def start_server(self, timeout: float = 180) -> None:
        from flows.server import _seed_database  # a migrated empty DB when one exists: ~10 s saved

        home = Path(self.env["PREFECT_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        _seed_database(home)
        with open(self.root / "server.log", "ab") as log:  # the child keeps its own descriptor
            self.server = subprocess.Popen([BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                            str(self.port), "--no-ui"], env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not api_healthy(self.url, timeout=1.0):
            assert self.server.poll() is None, (self.root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Prefect server did not start"
            time.sleep(0.2)

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGINT)
            try:
                self.server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        self.server = None

    @contextmanager
    def client(self):
        from prefect import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.url}):
            with get_client(sync_client=True) as client:
                yield client

    def create_pool(self, name: str, limit: int | None) -> None:
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.workers.process import ProcessWorker

        with self.client() as client:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", concurrency_limit=limit,
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))

    # -- workers and CLI runs ----------------------------------------------------------------------
    def start_worker(self, pool: str) -> subprocess.Popen:
        with open(self.root / f"worker-{pool}.log", "ab") as log:
            worker = subprocess.Popen([BIN / "prefect", "worker", "start", "--pool", pool, "--type", "process"],
                                      env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.workers[pool] = worker
        return worker

    def kill_node(self, pool: str) -> None:
        """SIGKILL the pool's worker and every flow-run process under it: a machine gone."""
        worker = self.workers.pop(pool)
        _kill([worker.pid, *descendants(worker.pid)], signal.SIGKILL)
        worker.wait()

    def splitflow(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env or self.env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        self.others.append(process)
        return process

    def close(self) -> None:
        for process in self.others:
            if process.poll() is None:
                _kill([process.pid, *descendants(process.pid)], signal.SIGKILL)
        self.stop_workers()
        self.stop_server()

    def stop_workers(self) -> None:
        for worker in self.workers.values():
            tree = [worker.pid, *descendants(worker.pid)]
            _kill([worker.pid], signal.SIGINT)
            try:
                worker.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            _kill(tree, signal.SIGKILL)
            worker.wait()
        self.workers.clear()
