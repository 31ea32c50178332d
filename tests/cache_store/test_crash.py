"""Kill tests: writers SIGKILLed mid-write leave nothing partial; a re-run completes bitwise."""

from __future__ import annotations

import random
import signal
import time

import pytest
import torch

from cache_store import open_cache
from tests.cache_store.conftest import finish, start_writer
from tests.cache_store.samples import key_of, make_entry, same_entry

N, SCALE = 120, 2


def _kill_after(proc, puts: int, rng: random.Random, max_wait: float = 0.02) -> None:
    """Let the writer put ``puts`` entries, wait a random few ms, then SIGKILL it."""
    seen = 0
    for line in proc.stdout:
        if line.startswith("put"):
            seen += 1
        if seen >= puts:
            break
    time.sleep(rng.uniform(0, max_wait))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "writer finished before it could be killed"


def _assert_visible_entries_are_whole(url: str) -> int:
    reader = open_cache(url)
    report = reader.verify()
    assert report.errors == []
    for key in reader.keys():
        i = int(reader.get(key)["meta"]["row"])
        assert key == key_of(i) and same_entry(reader.get(key), make_entry(i, SCALE))
    return len(reader.keys())


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_sigkill_mid_write_then_rerun_equals_uninterrupted_run(tmp_path, backend):
    url = str(tmp_path / "killed")
    args = ("--backend", backend, "--writer", "part-0-of-1", "--stop", str(N), "--commit-every", "7",
            "--scale", str(SCALE), "--delay", "0.004")
    rng = random.Random(backend)
    visible = []
    for puts in (3, 30):  # puts of each run (a run skips what is committed)
        _kill_after(start_writer(url, *args), puts, rng)
        visible.append(_assert_visible_entries_are_whole(url))
    assert visible == sorted(visible) and visible[-1] < N  # progress kept, never complete yet

    encoded = finish(start_writer(url, *args))
    assert encoded == N - visible[-1]  # resumed: only what was not committed is re-encoded

    reference = open_cache(tmp_path / "reference", "a", backend=backend, fingerprint="test-encoders")
    for i in range(N):
        reference.put(key_of(i), make_entry(i, SCALE))
    reference.commit()
    resumed = open_cache(url)
    assert resumed.keys() == reference.keys()
    assert all(same_entry(resumed.get(k), reference.get(k)) for k in reference.keys())
    assert resumed.verify().ok
    stats = resumed.stats()
    assert stats["orphan_parts"] == 0 and stats["duplicates"] == 0  # the writer's dead parts were removed


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_cleanup_removes_what_dead_writers_left_but_spares_young_files(tmp_path, backend):
    url = str(tmp_path / "c")
    args = ("--backend", backend, "--writer", "part-1-of-2", "--stop", "40", "--commit-every", "6",
            "--delay", "0.004")
    _kill_after(start_writer(url, *args), 8, random.Random(1), max_wait=0)  # before the 2nd commit (12)
    store = open_cache(url, "a", writer="part-0-of-2")  # another writer: leaves part 1's files alone
    before = store.stats()
    assert store.cleanup(min_age_s=3600) == []  # too young: could be a writer still running
    leftovers = store.cleanup(min_age_s=0)
    assert leftovers and store.stats()["orphan_parts"] == 0
    after = store.stats()
    assert after["files"] < before["files"] and after["entries"] == before["entries"]
    assert store.verify().errors == []


def test_a_writer_whose_part_was_removed_refuses_to_commit(tmp_path):
    """Two processes with one writer id: the second drops the first's part as dead; the first
    must then fail loudly instead of publishing a manifest that points at nothing."""
    first = open_cache(tmp_path / "c", "a", writer="part-0-of-1")
    for i in range(3):  # 36 MB: more than one 32 MiB shard is already on disk
        first.put(f"big{i}", {"x": torch.zeros(3 * 2**20, dtype=torch.float32)})
    second = open_cache(tmp_path / "c", "a", writer="part-0-of-1")
    assert second.keys() == []
    with pytest.raises(Exception, match="vanished before its commit"):
        first.commit()
    assert open_cache(tmp_path / "c").keys() == []
