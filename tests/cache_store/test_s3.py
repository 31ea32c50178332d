"""The zarr backend on s3:// against a real S3-compatible server (moto) on 127.0.0.1."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from cache_store import CacheFormatError, open_cache
from cache_store.report import inspect_cache
from tests.cache_store.conftest import finish, run_forked_writers, start_writer
from tests.cache_store.samples import key_of, make_entry, same_entry


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_write_on_one_machine_read_on_another(s3_bucket, backend):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/cache.zarr"
    # preprocessing machines: two concurrent writer processes
    jobs = [(list(range(w, 12, 2)), {"backend": backend, "writer": f"part-{w}-of-2", "commit_every": 4,
                                      "storage_options": options}) for w in range(2)]
    assert run_forked_writers(url, jobs) == [6, 6]
    store = open_cache(url, "a", storage_options=options)
    store.set_dataset_keys([key_of(i) for i in range(13)])

    # training machine: a fresh reader sees everything committed, bit-exact
    reader = open_cache(url, storage_options=options)
    assert reader.backend == backend and reader.keys() == sorted(key_of(i) for i in range(12))
    for i in range(12):
        assert same_entry(reader.get(key_of(i)), make_entry(i))
    assert reader.missing_keys() == [key_of(12)]
    info = inspect_cache(url, verify=True, storage_options=options)
    assert info["entries"] == 12 and info["errors"] == [] and info["missing"] == 1 and not info["ok"]
    assert info["files"] < 12 * 3


def test_killed_s3_writer_leaves_nothing_visible_and_resumes(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/killed.zarr"
    env = {"CACHE_STORAGE_OPTIONS": json.dumps(options)}
    args = ("--writer", "w0", "--stop", "30", "--commit-every", "4", "--delay", "0.01")
    proc = start_writer(url, *args, env=env)
    for n, line in enumerate(proc.stdout):
        if n >= 10:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    reader = open_cache(url, storage_options=options)
    assert 0 < len(reader.keys()) < 30 and reader.verify().errors == []
    done = len(reader.keys())
    assert finish(start_writer(url, *args, env=env)) == 30 - done
    reader.refresh()
    assert reader.keys() == sorted(key_of(i) for i in range(30))
    assert all(same_entry(reader.get(key_of(i)), make_entry(i)) for i in range(30))


def test_fingerprint_is_checked_on_s3(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/fp.zarr"
    open_cache(url, "a", fingerprint="enc-a", storage_options=options)
    with pytest.raises(CacheFormatError, match="'enc-a'.*'enc-b'"):
        open_cache(url, "a", fingerprint="enc-b", storage_options=options)


class _Samples(torch.utils.data.Dataset):
    def __init__(self, store, keys):
        self.store, self.keys = store, keys

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        return self.store.get(self.keys[i])["latents"]


@pytest.mark.parametrize("backend", ["zarr", "pth"])
def test_dataloader_workers_read_a_store_opened_before_fork(s3_bucket, backend):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/fork.zarr"
    writer = open_cache(url, "a", backend=backend, storage_options=options)
    for i in range(8):
        writer.put(key_of(i), make_entry(i))
    writer.commit()
    reader = open_cache(url, storage_options=options)
    reader.get(key_of(0))  # the parent has live connections before the workers fork
    keys = [key_of(i) for i in range(8)]
    loader = torch.utils.data.DataLoader(_Samples(reader, keys), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    got = list(loader)
    assert all(torch.equal(t, make_entry(i)["latents"]) for i, t in enumerate(got))
