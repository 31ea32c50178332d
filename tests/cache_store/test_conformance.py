"""One suite, both backends: the CacheStore contract the stages rely on."""

from __future__ import annotations

import json

import pytest
import torch

from cache_store import CacheFormatError, CacheStore, IncompleteCacheError, open_cache
from tests.cache_store.samples import key_of, make_entry, same_entry

BACKENDS = ["zarr", "pth"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_satisfies_the_protocol(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend)
    assert isinstance(store, CacheStore)
    assert store.backend == backend
    assert isinstance(open_cache(tmp_path / "c"), CacheStore)


def test_every_dtype_round_trips_bit_exact(tmp_path, backend):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g)
    entry = {
        "bf16": x.to(torch.bfloat16), "f16": x.half(), "f32": x, "f64": x.double(),
        "f8": x.to(torch.float8_e4m3fn), "i64": torch.arange(7), "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(5, dtype=torch.uint8), "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "nan_bits": torch.tensor([float("nan"), float("inf"), -0.0]).to(torch.bfloat16),
        "strided": x.t(),  # non-contiguous input is stored contiguous, same values
        "meta": {"prompt": "a cat ✓", "height": 64, "files": ["a.png"], "nested": {"k": [1, 2.5, None]}},
    }
    store = open_cache(tmp_path / "c", "a", backend=backend)
    store.put("k1", entry)
    store.commit()
    got = open_cache(tmp_path / "c").get("k1")
    assert same_entry(got, entry)
    assert got["bf16"].dtype == torch.bfloat16 and got["f8"].dtype == torch.float8_e4m3fn


def test_shapes_vary_per_entry_and_keys_are_sorted(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend)
    for i in range(9):
        store.put(key_of(i), make_entry(i))
        if i % 4 == 3:
            store.commit()
    store.commit()
    reader = open_cache(tmp_path / "c")
    assert reader.keys() == sorted(key_of(i) for i in range(9))
    for i in range(9):
        assert same_entry(reader.get(key_of(i)), make_entry(i))
    assert reader.stats()["parts"] == 3


def test_entries_are_invisible_until_commit(tmp_path, backend):
    writer = open_cache(tmp_path / "c", "a", backend=backend)
    writer.put(key_of(0), make_entry(0))
    assert writer.has(key_of(0))  # a writer sees its own pending entries (no double encode)
    reader = open_cache(tmp_path / "c")
    assert not reader.has(key_of(0)) and reader.keys() == []
    with pytest.raises(KeyError, match="not committed"):
        writer.get(key_of(0))
    writer.commit()
    assert not reader.has(key_of(0))
    reader.refresh()
    assert reader.keys() == [key_of(0)]


def test_putting_a_present_key_again_is_a_no_op(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend)
    store.put(key_of(1), make_entry(1))
    store.commit()
    store.put(key_of(1), make_entry(1))
    store.commit()
    assert store.stats()["parts"] == 1 and store.stats()["duplicates"] == 0


def test_require_complete_counts_missing_entries(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend)
    keys = [key_of(i) for i in range(20)]
    for k, i in zip(keys[:17], range(17)):
        store.put(k, make_entry(i))
    store.commit()
    store.set_dataset_keys(keys)
    reader = open_cache(tmp_path / "c")
    with pytest.raises(IncompleteCacheError) as err:
        reader.require_complete()
    assert str(err.value) == (f"cache {tmp_path / 'c'}: 3 of 20 entries missing (e.g. {keys[17]}); "
                              "run preprocess")
    assert reader.missing_keys() == keys[17:]
    assert reader.require_complete(allow_partial=True) == keys[:17]
    assert reader.stats()["complete"] is False


def test_a_row_removed_from_the_metadata_is_not_trained_on(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend)
    keys = [key_of(i) for i in range(5)]
    for i, k in enumerate(keys):
        store.put(k, make_entry(i))
    store.commit()
    store.set_dataset_keys(keys)
    store.set_dataset_keys([keys[3], keys[0], keys[4]])  # metadata shrank and was reordered
    reader = open_cache(tmp_path / "c")
    assert reader.require_complete() == [keys[3], keys[0], keys[4]]
    assert reader.dataset_keys() == [keys[3], keys[0], keys[4]]
    assert len(reader.keys()) == 5 and reader.stats()["complete"] is True


def test_fingerprint_mismatch_names_both(tmp_path, backend):
    open_cache(tmp_path / "c", "a", backend=backend, fingerprint="qwen-image/abc")
    with pytest.raises(CacheFormatError, match="'qwen-image/abc'.*'qwen-image/def'"):
        open_cache(tmp_path / "c", "a", fingerprint="qwen-image/def")
    assert open_cache(tmp_path / "c", "a", fingerprint="qwen-image/abc").fingerprint == "qwen-image/abc"
    assert open_cache(tmp_path / "c").fingerprint == "qwen-image/abc"


def test_backend_is_detected_and_checked(tmp_path, backend):
    open_cache(tmp_path / "c", "a", backend=backend)
    assert open_cache(tmp_path / "c", "a").backend == backend
    other = "pth" if backend == "zarr" else "zarr"
    with pytest.raises(CacheFormatError, match=f"is a {backend} cache, not {other}"):
        open_cache(tmp_path / "c", "r", backend=other)


def test_read_only_store_refuses_writes(tmp_path, backend):
    open_cache(tmp_path / "c", "a", backend=backend)
    reader = open_cache(tmp_path / "c")
    with pytest.raises(PermissionError, match="read-only"):
        reader.put(key_of(0), make_entry(0))
    with pytest.raises(PermissionError, match="read-only"):
        reader.set_dataset_keys([])


def test_bad_entries_are_refused_with_the_field_named(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend)
    with pytest.raises(TypeError, match=r"entry k: field 'height' is a int, not a tensor"):
        store.put("k", {"latents": torch.zeros(2), "height": 4})
    with pytest.raises(TypeError, match=r"entry k meta.when: value of type object"):
        store.put("k", {"latents": torch.zeros(2), "meta": {"when": object()}})
    with pytest.raises(ValueError, match="cache key '../x'"):
        store.put("../x", {"latents": torch.zeros(2)})
    store.commit()
    assert open_cache(tmp_path / "c").keys() == []


def test_stats_and_verify(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend, fingerprint="fp")
    for i in range(6):
        store.put(key_of(i), make_entry(i))
    store.commit()
    store.set_dataset_keys([key_of(i) for i in range(7)])
    stats = open_cache(tmp_path / "c").stats()
    assert {k: stats[k] for k in ("entries", "parts", "fingerprint", "complete", "missing")} == {
        "entries": 6, "parts": 1, "fingerprint": "fp", "complete": False, "missing": 1}
    assert stats["files"] >= 4 and stats["bytes"] > 0
    report = open_cache(tmp_path / "c").verify()
    assert report.checked == 6 and report.errors == [] and report.missing == [key_of(6)] and not report.ok


def test_verify_flags_nan_unless_allowed(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend)
    store.put("good", {"x": torch.ones(3)})
    store.put("bad", {"x": torch.tensor([1.0, float("nan")]).to(torch.bfloat16)})
    store.commit()
    report = open_cache(tmp_path / "c").verify()
    assert len(report.errors) == 1 and "entry bad" in report.errors[0] and "'x' holds NaN or Inf" in report.errors[0]
    assert open_cache(tmp_path / "c").verify(allow_nonfinite=True).ok


def test_refuses_to_write_into_a_foreign_folder(tmp_path, backend):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "weights.pth").write_bytes(b"not ours")
    with pytest.raises(CacheFormatError, match="not a splitflow cache"):
        open_cache(tmp_path / "models", "a", backend=backend)
    with pytest.raises(CacheFormatError, match="no splitflow cache here"):
        open_cache(tmp_path / "nothing")


def test_context_manager_commits_on_success_only(tmp_path, backend):
    with open_cache(tmp_path / "c", "a", backend=backend) as store:
        store.put(key_of(0), make_entry(0))
    with pytest.raises(RuntimeError):
        with open_cache(tmp_path / "c", "a") as store:
            store.put(key_of(1), make_entry(1))
            raise RuntimeError("encoder crashed")
    assert open_cache(tmp_path / "c").keys() == [key_of(0)]


def test_manifest_is_plain_json(tmp_path, backend):
    store = open_cache(tmp_path / "c", "a", backend=backend, writer="part-0-of-2")
    store.put(key_of(0), make_entry(0))
    store.commit()
    [manifest] = list((tmp_path / "c" / "manifests").iterdir())
    assert manifest.name.startswith("part-0-of-2-")
    doc = json.loads(manifest.read_text())
    assert doc["entries"][0]["key"] == key_of(0)
    assert doc["entries"][0]["tensors"]["latents"]["dtype"] == "bfloat16"
