"""The commit protocol shared by both backends: parts, manifests, the committed index.

A writer appends entries to a *part* it alone owns (named ``<writer>-<random>``), then commits
it by writing ``manifests/<part>.json`` last, in one atomic write.  Readers build their index
from manifests only, so data of a part that was never committed (writer killed) is invisible,
and writers never touch each other's files: no locks, on a local disk or on S3 alike.
Backends (zarr, pth) only decide how an entry's bytes are stored.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import Any, Callable, Iterable

import torch

from ._fs import Root
from .base import CacheFormatError, Entry, IncompleteCacheError, VerifyReport
from .codec import KEY_RE

MANIFESTS = "manifests"
DATASET_KEYS = "dataset-keys.json"
WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}-[0-9a-f]{12}$")  # <writer>-<random>
# Keys of auxiliary entries (the empty prompt's embedding for caption dropout): stored, verified and
# read like any entry, but they are no samples, so keys() leaves them out.
AUX_PREFIX = "aux."


class PartStore:
    """Backend-independent half of a CacheStore; subclasses implement the ``_`` hooks."""

    backend = "?"
    family: str | None = None  # model family the entries were encoded for (from the cache header)
    commit_guard: Callable[[], None] | None = None  # raises when this writer lost its part's lock

    def __init__(self, root: Root, mode: str, fingerprint: str | None, writer: str | None):
        if writer is not None and not WRITER_RE.match(writer):
            raise ValueError(f"writer id {writer!r} must match {WRITER_RE.pattern}")
        self._root, self._pid = root, os.getpid()
        self.url, self.mode, self.fingerprint = root.url, mode, fingerprint
        self.writer = writer or "writer"
        self._part: str | None = None          # part being written by this process
        self._pending: dict[str, dict] = {}    # key -> record, not yet committed
        self._pending_skips: dict[str, dict] = {}  # key -> why its row was skipped, not yet committed
        self.refresh()

    @property
    def root(self) -> Root:
        self._reconnect_if_forked()
        return self._root

    def _reconnect_if_forked(self) -> None:
        """DataLoader workers fork the store; network clients (s3fs) cannot cross a fork."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._root = self._root.reopen()
            self._after_fork()

    # ---- backend hooks ------------------------------------------------------------------
    def _after_fork(self) -> None: ...
    def _start_part(self, part: str) -> None: ...
    def _write_entry(self, part: str, key: str, entry: Entry) -> dict[str, Any]: raise NotImplementedError
    def _finish_part(self, part: str) -> None: ...
    def _read_entry(self, part: str, key: str, record: dict[str, Any]) -> Entry: raise NotImplementedError
    def _data_parts(self) -> list[str]: return []          # parts holding data, committed or not
    def _remove_part_data(self, part: str) -> None: ...

    # ---- index --------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the manifests (other writers may have committed since we opened)."""
        self._index: dict[str, tuple[str, dict]] = {}
        self._skips: dict[str, dict] = {}  # key -> {"row", "file", "reason"}: bad rows a writer skipped
        self._parts: list[str] = []
        self.duplicates = 0
        self.bad_parts: dict[str, str] = {}
        for name in self.root.listdir(MANIFESTS):
            if not name.endswith(".json"):
                continue
            part = name[: -len(".json")]
            try:
                manifest = self._load_manifest(part)
            except CacheFormatError as e:  # tampered manifest: its entries count as missing
                self.bad_parts[part] = str(e)
                continue
            self._parts.append(part)
            for rec in manifest.get("skipped", []):
                self._skips.setdefault(rec["key"], {k: v for k, v in rec.items() if k != "key"})
            for rec in manifest["entries"]:
                if rec["key"] in self._index:
                    self.duplicates += 1  # same content committed twice: first part (by name) wins
                else:
                    self._index[rec["key"]] = (part, rec)
        self._sorted_keys = sorted(self._index)

    def _load_manifest(self, part: str) -> dict[str, Any]:
        raw = self.root.read_bytes(f"{MANIFESTS}/{part}.json")
        try:
            manifest = json.loads(raw)
            assert isinstance(manifest["entries"], list)
        except Exception as e:
            raise CacheFormatError(f"cache {self.url}: manifest of part {part} is unreadable: {e}") from e
        return manifest

    def keys(self) -> list[str]:
        return [k for k in self._sorted_keys if not k.startswith(AUX_PREFIX)]

    def shapes(self, key: str) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape in entry ``key``, from the manifest (no data is read)."""
        if key not in self._index:
            raise KeyError(f"cache {self.url}: no committed entry {key}")
        return {name: tuple(spec["shape"]) for name, spec in self._index[key][1]["tensors"].items()}

    def has(self, key: str) -> bool:
        return key in self._index or key in self._pending

    def get(self, key: str) -> Entry:
        if key not in self._index:
            hint = " (put but not committed yet)" if key in self._pending else ""
            raise KeyError(f"cache {self.url}: no committed entry {key}{hint}")
        part, record = self._index[key]
        where = f"entry {key} (part {part})"
        try:
            return self._read_entry(part, key, record)
        except CacheFormatError:
            raise
        except Exception as e:  # decoder / IO errors: say which entry, keep the cause
            raise CacheFormatError(f"cache {self.url}: {where} is unreadable: {type(e).__name__}: {e}") from e

    # ---- writing ------------------------------------------------------------------------
    def put(self, key: str, entry: Entry) -> None:
        """Buffer ``entry`` under ``key``; a key already present is skipped (same content)."""
        if self.mode == "r":
            raise PermissionError(f"cache {self.url} was opened read-only")
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise ValueError(f"cache key {key!r} must match {KEY_RE.pattern} (use entry_key())")
        if self.has(key):
            return
        if self._part is None:
            self._part = f"{self.writer}-{uuid.uuid4().hex[:12]}"
            self._start_part(self._part)
        self._pending[key] = self._write_entry(self._part, key, entry)

    def put_skipped(self, key: str, info: dict[str, Any]) -> None:
        """Record that the row keyed ``key`` was skipped as bad (``info``: row, file, reason).

        Committed with the part's manifest, so which rows were skipped and why is read from the
        cache itself (finalize, training, status), never from a result passed between processes.
        """
        if self.mode == "r":
            raise PermissionError(f"cache {self.url} was opened read-only")
        self._pending_skips[key] = {k: info.get(k) for k in ("row", "file", "reason")}

    def skipped(self) -> dict[str, dict]:
        """Committed skip records: key -> {"row", "file", "reason"} (first record per key wins)."""
        return dict(self._skips)

    def commit(self) -> None:
        """Publish every entry (and skip record) put since the last commit, all at once."""
        if not self._pending and not self._pending_skips:
            return
        if self.commit_guard is not None:
            self.commit_guard()  # never publish a part whose lock another writer took over
        if self._part is None:  # only skip records: a manifest without data
            self._part = f"{self.writer}-{uuid.uuid4().hex[:12]}"
        else:
            self._finish_part(self._part)
        part = self._part
        entries = [{"key": k, **rec} for k, rec in self._pending.items()]
        skipped = [{"key": k, **rec} for k, rec in self._pending_skips.items()]
        manifest = {"part": part, "writer": self.writer, "backend": self.backend,
                    "fingerprint": self.fingerprint, "committed_at": time.time(), "entries": entries,
                    "skipped": skipped}
        self.root.write_bytes(f"{MANIFESTS}/{part}.json", json.dumps(manifest).encode())  # the commit point
        self._parts.append(part)
        for rec in entries:
            self._index.setdefault(rec["key"], (part, rec))
        for rec in skipped:
            self._skips.setdefault(rec["key"], {k: v for k, v in rec.items() if k != "key"})
        self._sorted_keys = sorted(self._index)
        self._part, self._pending, self._pending_skips = None, {}, {}

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None and self.mode != "r":
            self.commit()

    # ---- what the dataset needs ---------------------------------------------------------
    def set_dataset_keys(self, keys: Iterable[str]) -> None:
        if self.mode == "r":
            raise PermissionError(f"cache {self.url} was opened read-only")
        keys = list(keys)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise TypeError(f"dataset keys must be strings, got {bad[0]!r}")
        doc = {"count": len(keys), "keys": keys, "written_at": time.time()}
        self.root.write_bytes(DATASET_KEYS, json.dumps(doc).encode())

    def dataset_keys(self) -> list[str] | None:
        raw = self.root.read_bytes(DATASET_KEYS)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            assert len(doc["keys"]) == doc["count"]
        except Exception as e:
            raise CacheFormatError(f"cache {self.url}: {DATASET_KEYS} is unreadable: {e}") from e
        return list(doc["keys"])

    def missing_keys(self) -> list[str]:
        wanted = self.dataset_keys() or []
        return list(dict.fromkeys(k for k in wanted if k not in self._index))

    def require_complete(self, allow_partial: bool = False) -> list[str]:
        """Keys to train on, in dataset order; refuses a cache that lacks some unless told."""
        wanted = self.dataset_keys()
        if wanted is None:
            return self.keys()  # no dataset recorded (e.g. an imported cache): all entries
        missing = self.missing_keys()
        if missing and not allow_partial:
            total = len(dict.fromkeys(wanted))
            raise IncompleteCacheError(
                f"cache {self.url}: {len(missing)} of {total} entries missing "
                f"(e.g. {missing[0]}); run preprocess"
                + (f" ({len(self.bad_parts)} unreadable manifests: run `splitflow cache verify`)"
                   if self.bad_parts else ""))
        return [k for k in wanted if k in self._index]

    # ---- checks and numbers -------------------------------------------------------------
    def verify(self, allow_nonfinite: bool = False) -> VerifyReport:
        """Read every committed entry: checksums, dtypes and shapes, finiteness."""
        report = VerifyReport(errors=list(self.bad_parts.values()))
        try:
            report.missing = self.missing_keys()
        except CacheFormatError as e:  # an unreadable dataset-keys.json is reported, not a crash
            report.errors.append(str(e))
        for key in self._sorted_keys:
            report.checked += 1
            try:
                entry = self.get(key)
            except CacheFormatError as e:
                report.errors.append(str(e))
                continue
            if allow_nonfinite:
                continue
            for name, t in entry.items():
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                    report.errors.append(f"cache {self.url}: entry {key} (part {self._index[key][0]}) "
                                         f"field {name!r} holds NaN or Inf")
        return report

    def orphan_parts(self) -> list[str]:
        """Parts with data but no manifest: a writer died (or is still writing)."""
        committed = set(self._parts) | set(self.bad_parts)
        return [p for p in self._data_parts()
                if PART_RE.match(p) and p not in committed and p != self._part]

    def cleanup(self, min_age_s: float = 3600.0) -> list[str]:
        """Delete what killed writers left: orphan parts and temp files older than ``min_age_s``.

        Younger ones may belong to a writer that is still running, so they stay.
        """
        if self.mode == "r":
            raise PermissionError(f"cache {self.url} was opened read-only")
        removed = []
        for part in self.orphan_parts():
            if self._older_than(self._part_mtime(part), min_age_s):
                self._remove_part_data(part)
                removed.append(part)
        for rel in self._junk_files():
            if self._older_than(self.root.modified(rel), min_age_s):
                self.root.remove(rel)
                removed.append(rel)
        return removed

    @staticmethod
    def _older_than(mtime: float | None, min_age_s: float) -> bool:
        return mtime is not None and time.time() - mtime >= min_age_s

    def _junk_files(self) -> list[str]:
        """Temp files of interrupted atomic writes (names end in .partial)."""
        return [rel for rel in self.root.files() if rel.endswith(".partial")]

    def _part_mtime(self, part: str) -> float | None:
        return None

    def _drop_own_orphans(self) -> None:
        """A writer id runs once at a time, so its uncommitted parts are dead: remove them."""
        for part in self.orphan_parts():
            if part.rsplit("-", 1)[0] == self.writer:
                self._remove_part_data(part)

    def stats(self) -> dict[str, Any]:
        files = self.root.files()
        try:
            wanted, keys_error = self.dataset_keys(), None
        except CacheFormatError as e:  # reported by inspect/verify instead of crashing them
            wanted, keys_error = None, str(e)
        missing = self.missing_keys() if wanted is not None else []
        return {
            "dataset_keys_error": keys_error,
            "url": self.url, "backend": self.backend, "fingerprint": self.fingerprint,
            "entries": len(self.keys()), "aux_entries": len(self._index) - len(self.keys()),
            "parts": len(self._parts),
            "bytes": sum(files.values()), "files": len(files),
            "tensor_bytes": sum(rec["nbytes"] for _, rec in self._index.values()),
            "dataset_keys": None if wanted is None else len(wanted), "missing": len(missing),
            "complete": None if wanted is None else not missing,
            "duplicates": self.duplicates, "orphan_parts": len(self.orphan_parts()),
            "bad_parts": sorted(self.bad_parts),
        }
