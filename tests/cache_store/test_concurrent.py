"""Several writer processes fill one cache at once; changing their number re-encodes nothing."""

from __future__ import annotations

import pytest

from cache_store import open_cache
from tests.cache_store.conftest import run_forked_writers
from tests.cache_store.samples import key_of, make_entry, same_entry


def split_jobs(backend: str, n_writers: int, stop: int) -> list:
    """Rows i % n == w for writer w, as the preprocess stage splits them."""
    return [(list(range(w, stop, n_writers)),
             {"backend": backend, "writer": f"part-{w}-of-{n_writers}", "commit_every": 4, "delay": 0.005})
            for w in range(n_writers)]


def assert_cache_holds(url: str, n: int) -> None:
    reader = open_cache(url)
    assert reader.keys() == sorted(key_of(i) for i in range(n))
    assert reader.verify().errors == []
    for i in range(n):
        assert same_entry(reader.get(key_of(i)), make_entry(i))


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_concurrent_writers_then_fewer_writers(tmp_path, backend):
    url = str(tmp_path / "shared")
    assert run_forked_writers(url, split_jobs(backend, 4, 60)) == [15, 15, 15, 15]
    assert_cache_holds(url, 60)
    assert open_cache(url).stats()["duplicates"] == 0

    # the dataset grew by 20 rows and we now run 3 writers: only the new rows are encoded
    assert sum(run_forked_writers(url, split_jobs(backend, 3, 80))) == 20
    assert_cache_holds(url, 80)
    stats = open_cache(url).stats()
    assert stats["duplicates"] == 0 and stats["orphan_parts"] == 0 and stats["parts"] >= 4 + 3


def test_overlapping_writers_never_lose_or_duplicate_visible_entries(tmp_path):
    """Two writers given the same rows (a misconfigured split) race; the index stays exact."""
    url = str(tmp_path / "raced")
    jobs = [(list(range(24)), {"writer": f"w{w}", "commit_every": 3, "delay": 0.005}) for w in range(2)]
    run_forked_writers(url, jobs)
    assert_cache_holds(url, 24)
    stats = open_cache(url).stats()
    assert stats["entries"] == 24  # a key committed by both is listed once (first part by name wins)
