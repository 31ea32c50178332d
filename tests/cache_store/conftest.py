"""Fixtures for the cache tests: writer subprocesses and a real S3-compatible server."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.cache_store.writer_proc import write_rows

REPO = Path(__file__).resolve().parents[2]


def writer_cmd(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "tests.cache_store.writer_proc", str(url), *args]


def start_writer(url: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(writer_cmd(url, *args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def finish(proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait for a writer; return how many entries it encoded (fails the test on error)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"writer failed ({proc.returncode}):\n{err}"
    return int(out.strip().splitlines()[-1].split()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server as a real subprocess on 127.0.0.1; yields fsspec storage options."""
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    if exe is None:
        pytest.fail("moto_server not installed (pip install 'moto[server]')")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.2)
        yield {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket per test, created with boto3 against the server."""
    import boto3

    name = f"cache-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                          endpoint_url=s3_server["client_kwargs"]["endpoint_url"], region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return name, s3_server


def _forked_writer(queue, url, rows, kwargs):
    try:
        queue.put(("ok", write_rows(url, rows, say=lambda m: None, **kwargs)))
    except BaseException as e:  # report, never hang the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))


def run_forked_writers(url: str, jobs: list[tuple[list[int], dict]], timeout: float = 120) -> list[int]:
    """Run writers as real, concurrent processes (forked: no interpreter start-up per writer).

    ``jobs``: one (rows, write_rows kwargs) per process.  Returns each one's encoded count.
    """
    ctx = multiprocessing.get_context("fork")
    queues = [ctx.Queue() for _ in jobs]
    procs = [ctx.Process(target=_forked_writer, args=(q, url, rows, kw)) for q, (rows, kw) in zip(queues, jobs)]
    for p in procs:
        p.start()
    results = [q.get(timeout=timeout) for q in queues]
    for p in procs:
        p.join(timeout=timeout)
    errors = [msg for status, msg in results if status == "error"]
    assert not errors, errors
    return [n for _, n in results]
