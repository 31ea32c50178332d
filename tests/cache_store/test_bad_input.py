"""Truncated or tampered files and altered manifests: a clear error naming the entry, and
nothing else in the cache is touched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from cache_store import CacheFormatError, IncompleteCacheError, open_cache
from tests.cache_store.samples import key_of, make_entry, same_entry


def build(path: Path, backend: str, parts: int = 2, per_part: int = 3, **kwargs) -> list[list[str]]:
    """A cache of ``parts`` committed parts; returns the keys of each part."""
    store = open_cache(path, "a", backend=backend, **kwargs)
    keys = []
    for p in range(parts):
        keys.append([key_of(p * per_part + j) for j in range(per_part)])
        for j in range(per_part):
            store.put(key_of(p * per_part + j), make_entry(p * per_part + j, scale=4))
        store.commit()
    store.set_dataset_keys([k for ks in keys for k in ks])
    return keys


def snapshot(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


def manifest_of(path: Path, key: str) -> Path:
    for m in (path / "manifests").iterdir():
        if any(e["key"] == key for e in json.loads(m.read_text())["entries"]):
            return m
    raise AssertionError(key)


def zarr_shard(path: Path, key: str) -> Path:
    part = manifest_of(path, key).stem
    return path / "parts" / part / "c" / "0"


def assert_only_these_fail(path: Path, bad: list[str], good: list[str], match: str) -> None:
    before = snapshot(path)
    reader = open_cache(path)
    for key in bad:
        with pytest.raises(CacheFormatError, match=f"entry {key}.*{match}"):
            reader.get(key)
    for key in good:
        reader.get(key)
    report = reader.verify()
    assert len(report.errors) == len(bad) and all(any(k in e for e in report.errors) for k in bad)
    assert snapshot(path) == before  # reading and verifying never modify the cache


@pytest.mark.parametrize("compression", ["zstd", None])
def test_zarr_truncated_shard(tmp_path, compression):
    keys = build(tmp_path, "zarr", compression=compression)
    shard = zarr_shard(tmp_path, keys[0][0])
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    reader = open_cache(tmp_path)
    report = reader.verify()
    assert all(k in " ".join(report.errors) for k in keys[0])  # every entry of the part is named
    for k, i in zip(keys[1], range(3, 6)):
        assert same_entry(reader.get(k), make_entry(i, scale=4))  # the other part is untouched


@pytest.mark.parametrize("compression", ["zstd", None])
def test_zarr_flipped_byte(tmp_path, compression):
    keys = build(tmp_path, "zarr", compression=compression)
    shard = zarr_shard(tmp_path, keys[1][1])
    data = bytearray(shard.read_bytes())
    rec = next(e for e in json.loads(manifest_of(tmp_path, keys[1][1]).read_text())["entries"]
               if e["key"] == keys[1][1])
    data[rec["offset"] + 100] ^= 0x40  # chunks come first in a shard: this is inside the entry
    shard.write_bytes(bytes(data))
    before = snapshot(tmp_path)
    report = open_cache(tmp_path).verify()
    assert len(report.errors) >= 1 and all(keys[1][0] in e or keys[1][1] in e or keys[1][2] in e
                                           for e in report.errors)
    for k in keys[0]:
        open_cache(tmp_path).get(k)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_manifest_dtype_or_shape_edited(tmp_path, backend):
    keys = build(tmp_path, backend)
    victim = keys[0][1]
    m = manifest_of(tmp_path, victim)
    doc = json.loads(m.read_text())
    rec = next(e for e in doc["entries"] if e["key"] == victim)
    rec["tensors"]["latents"]["dtype"] = "float16"  # same size: only the record checksum can tell
    m.write_text(json.dumps(doc))
    assert_only_these_fail(tmp_path, [victim], keys[0][::2] + keys[1], "manifest record was altered")

    rec["tensors"]["latents"]["shape"] = [1, 2, 3]
    rec.pop("spec_crc32")
    m.write_text(json.dumps(doc))
    with pytest.raises(CacheFormatError, match=f"entry {victim}"):
        open_cache(tmp_path).get(victim)


def test_pth_file_truncated_or_replaced(tmp_path):
    keys = build(tmp_path, "pth")
    f0 = next(tmp_path.glob(f"entries/*/{keys[0][0]}.safetensors"))
    f0.write_bytes(f0.read_bytes()[:100])
    f1 = next(tmp_path.glob(f"entries/*/{keys[1][2]}.safetensors"))  # valid file, other dtype
    f1.write_bytes(st_save({"latents": torch.zeros(16, 32, 32, dtype=torch.float16)}))
    assert_only_these_fail(tmp_path, [keys[0][0], keys[1][2]], keys[0][1:] + keys[1][:2],
                           "checksum mismatch")
    f0.unlink()
    with pytest.raises(CacheFormatError, match=f"entry {keys[0][0]}.*file is missing"):
        open_cache(tmp_path).get(keys[0][0])


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_unreadable_manifest_is_named_and_its_entries_count_as_missing(tmp_path, backend):
    keys = build(tmp_path, backend)
    m = manifest_of(tmp_path, keys[1][0])
    m.write_text(m.read_text()[:50])
    reader = open_cache(tmp_path)
    assert reader.keys() == sorted(keys[0])
    report = reader.verify()
    assert any(f"manifest of part {m.stem} is unreadable" in e for e in report.errors)
    with pytest.raises(IncompleteCacheError, match="3 of 6 entries missing.*1 unreadable manifests"):
        reader.require_complete()
    assert reader.stats()["bad_parts"] == [m.stem]
