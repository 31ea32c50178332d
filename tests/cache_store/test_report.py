"""`splitflow cache inspect|verify` data: a dict for programs, text for people."""

from __future__ import annotations

from cache_store import open_cache
from cache_store.report import format_inspect, inspect_cache
from tests.cache_store.samples import key_of, make_entry


def test_inspect_and_verify(tmp_path):
    store = open_cache(tmp_path / "c", "a", fingerprint="qwen-image:abc")
    for i in range(4):
        store.put(key_of(i), make_entry(i))
    store.commit()
    store.set_dataset_keys([key_of(i) for i in range(5)])

    info = inspect_cache(str(tmp_path / "c"))
    assert info["ok"] and info["entries"] == 4 and info["parts"] == 1 and info["complete"] is False
    assert info["missing_examples"] == [key_of(4)] and not info["verified"]
    text = format_inspect(info)
    assert "qwen-image:abc" in text and "4 in 1 parts" in text and "1 missing: INCOMPLETE" in text

    checked = inspect_cache(str(tmp_path / "c"), verify=True)
    assert checked["checked"] == 4 and checked["errors"] == [] and not checked["ok"]  # 1 missing
    assert "verify       4 entries read, 0 bad, 1 missing: FAILED" in format_inspect(checked)

    store.put(key_of(4), make_entry(4))
    store.commit()
    done = inspect_cache(str(tmp_path / "c"), verify=True)
    assert done["ok"] and done["complete"] is True
    assert "complete" in format_inspect(done) and "OK" in format_inspect(done)


def test_inspect_of_nothing_says_so(tmp_path):
    info = inspect_cache(str(tmp_path / "none"))
    assert not info["ok"] and "no splitflow cache here" in format_inspect(info)
