"""File digests remembered across runs: a memo hit reads nothing, any rewrite is seen."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time

from cache_store.digests import DigestMemo


def _old(path, age_s: float = 3600) -> None:
    """Backdate a file, as weights written long ago are (a fresh file is never remembered: racy)."""
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))


def test_a_memo_hit_reads_nothing_and_a_same_size_edit_is_hashed_again(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x01" * 4096)
    _old(weights)
    memo_file = tmp_path / "memo" / "digests.sqlite"
    first = DigestMemo(memo_file)
    digest = first.digest(weights)
    assert digest == hashlib.sha256(b"\x01" * 4096).hexdigest() and first.hashed == 1

    again = DigestMemo(memo_file)  # a later run: the memo on disk answers, the file is not read
    assert again.digest(weights) == digest and again.hashed == 0

    with open(weights, "r+b") as handle:  # fine-tuned in place: same size, one byte differs
        handle.seek(100)
        handle.write(b"\x02")
    _old(weights, age_s=1800)
    edited = DigestMemo(memo_file)
    assert edited.digest(weights) != digest and edited.hashed == 1


def test_a_file_replaced_with_its_old_mtime_is_hashed_again(tmp_path):
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"a" * 100)
    _old(weights)
    memo_file = tmp_path / "digests.sqlite"
    before = DigestMemo(memo_file).digest(weights)
    stat = weights.stat()
    replacement = tmp_path / "w.tmp"
    replacement.write_bytes(b"b" * 100)  # same size, and copied with the old mtime (cp -p, rsync -t)
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    replacement.replace(weights)  # a new inode under the old name
    assert DigestMemo(memo_file).digest(weights) == hashlib.sha256(b"b" * 100).hexdigest() != before


def test_a_freshly_written_file_is_not_remembered(tmp_path):
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x" * 10)  # modified now: a same-tick rewrite could go unseen
    memo_file = tmp_path / "digests.sqlite"
    DigestMemo(memo_file).digest(weights)
    later = DigestMemo(memo_file)
    later.digest(weights)
    assert later.hashed == 1


def _digest_all(args):
    memo_file, paths = args
    memo = DigestMemo(memo_file)
    return [memo.digest(p) for p in paths]


def test_concurrent_processes_share_one_memo(tmp_path):
    files = []
    for i in range(40):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(bytes([i]) * 1000)
        _old(path)
        files.append(str(path))
    memo_file = str(tmp_path / "digests.sqlite")
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_digest_all, [(memo_file, files)] * 4)
    expected = [hashlib.sha256(bytes([i]) * 1000).hexdigest() for i in range(40)]
    assert all(result == expected for result in results)
    hit = DigestMemo(tmp_path / "digests.sqlite")
    assert [hit.digest(p) for p in files] == expected and hit.hashed == 0


def test_an_unusable_memo_still_gives_digests(tmp_path):
    memo_file = tmp_path / "digests.sqlite"
    memo_file.write_bytes(b"this is not a database" * 100)
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"w")
    _old(weights)
    assert DigestMemo(memo_file).digest(weights) == hashlib.sha256(b"w").hexdigest()
