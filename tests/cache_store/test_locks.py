"""One writer at a time: real processes holding locks on a local folder and on S3 (moto's server)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from cache_store import open_cache
from cache_store.locks import hold
from diffsynth_core.errors import LockHeldError
from tests.cache_store.samples import key_of, make_entry

REL = "locks/part-0-of-2.lock"


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """(url, storage options) of a folder on the local disk or in a fresh moto bucket."""
    if request.param == "local":
        return str(tmp_path / "cache"), None
    bucket, options = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/cache", options


def _hold_in_child(url: str, options) -> int:
    """Fork a process that takes the lock and sleeps until killed; return its pid once it holds it."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.close(read)
        try:
            with hold(url, REL, "part 0", storage_options=options, ttl_s=3.0):
                os.write(write, b"held")
                while True:
                    time.sleep(0.1)
        except BaseException as err:  # noqa: BLE001 - report, never run the parent's test code
            os.write(write, repr(err).encode())
        os._exit(1)
    os.close(write)
    answer = os.read(read, 4096).decode()
    os.close(read)
    assert answer == "held", answer
    return child


def _try_in_child(url: str, options) -> str:
    """A second process tries the lock; returns "acquired" or the refusal's message."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            with hold(url, REL, "part 0", storage_options=options):
                message = b"acquired"
        except LockHeldError as err:
            message = str(err).encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    message = os.read(read, 4096).decode()
    os.close(read)
    return message


def test_a_second_process_is_refused_naming_the_holder_and_a_sigkilled_holder_is_taken_over(place):
    url, options = place
    holder = _hold_in_child(url, options)
    try:
        refusal = _try_in_child(url, options)  # a second process, while the first holds the lock
        assert f"part 0 is in use by pid {holder} on {socket.gethostname()} since 20" in refusal
        with pytest.raises(LockHeldError, match=f"pid {holder} "):
            with hold(url, REL, "part 0", storage_options=options):
                pass
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    # the holder is gone (dead pid on this machine): the next writer takes over at once
    with hold(url, REL, "part 0", storage_options=options):
        assert f"pid {os.getpid()} " in _try_in_child(url, options)
    assert _try_in_child(url, options) == "acquired"  # released on exit: free again


def test_the_lock_is_reentrant_within_one_process(tmp_path):
    url = str(tmp_path)
    with hold(url, REL, "part 0") as outer:
        with hold(url, REL, "part 0") as inner:
            assert inner is outer
        assert "in use by pid" in _try_in_child(url, None)  # still held after the inner block
    assert _try_in_child(url, None) == "acquired"


def _write_lease(options, url: str, **fields) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"{url}/{REL}", **options)
    record = {"what": "part 0", "pid": 4242, "host": "gpu-node-7", "machine": "gpu-node-7/boot/pid:[1]",
              "since": time.time() - 3600, "ttl_s": 60, "token": "theirs", **fields}
    fs.pipe_file(path, json.dumps(record).encode())


def test_an_s3_lease_of_another_machine_is_refused_while_renewed_and_taken_over_once_expired(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/cache"
    _write_lease(options, url, renewed_at=time.time())
    with pytest.raises(LockHeldError, match="pid 4242 on gpu-node-7 since"):
        with hold(url, REL, "part 0", storage_options=options):
            pass
    _write_lease(options, url, renewed_at=time.time() - 61)  # its holder stopped renewing a minute ago
    with hold(url, REL, "part 0", storage_options=options) as lock:
        lock.verify()


def test_a_writer_that_lost_its_s3_lease_cannot_commit(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/cache"
    with hold(url, REL, "part 0", storage_options=options, ttl_s=0.6) as lock:
        store = open_cache(url, "a", fingerprint="test-encoders", writer="part-0-of-2", storage_options=options)
        store.commit_guard = lock.verify
        store.put(key_of(1), make_entry(1))
        store.commit()
        _write_lease(options, url, renewed_at=time.time())  # another machine took the part over
        deadline = time.time() + 20
        while lock.lost is None and time.time() < deadline:
            time.sleep(0.05)
        assert lock.lost == "another process took it over"
        store.put(key_of(2), make_entry(2))
        with pytest.raises(LockHeldError, match="was lost"):
            store.commit()
    assert open_cache(url, storage_options=options).keys() == [key_of(1)]
