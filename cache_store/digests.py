"""Content digests of files, remembered across runs so identity stays cheap to recompute.

Hashing every weight file of a 20B model on each run would cost minutes, so the sha256 of a
file is remembered in a small SQLite memo under the user's cache folder, keyed by the file's
real path and checked against its device, inode, size and mtime_ns: any rewrite of the file
(same size or not) changes at least one of them and the file is hashed again.  A digest is
remembered only when the file did not change while it was read and its mtime is not so
recent that a same-tick rewrite could go unseen (git's "racy clean" rule).

SQLite serialises concurrent processes itself (WAL, busy timeout); if the memo cannot be
opened (read-only home, corrupt file) digests are still computed, only not remembered.
``SPLITFLOW_CACHE_DIR`` moves the memo (default ``$XDG_CACHE_HOME/splitflow`` or
``~/.cache/splitflow``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

MEMO_FILE = "digests.sqlite"
RACY_SECONDS = 2.0  # a file modified this recently may change again within one mtime tick


def memo_dir() -> Path:
    explicit = os.environ.get("SPLITFLOW_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitflow"


class DigestMemo:
    """sha256 per file, remembered by (real path, dev, inode, size, mtime_ns)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else memo_dir() / MEMO_FILE
        self._local: dict[tuple, str] = {}  # this process's hits, also when the db is unusable
        self._db: sqlite3.Connection | None = None
        self._db_failed = False
        self._lock = threading.Lock()  # one connection, shared by threads (parts run in threads)
        self.hashed = 0  # files read in full by this process (for benchmarks and tests)

    def digest(self, path: str | os.PathLike) -> str:
        real = os.path.realpath(path)
        before = os.stat(real)
        stamp = (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns)
        known = self._local.get((real, *stamp)) or self._lookup(real, stamp)
        if known is not None:
            self._local[(real, *stamp)] = known
            return known
        with open(real, "rb") as handle:
            value = hashlib.file_digest(handle, "sha256").hexdigest()
        self.hashed += 1
        after = os.stat(real)
        unchanged = stamp == (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns)
        if unchanged and time.time() - after.st_mtime_ns / 1e9 > RACY_SECONDS:
            self._local[(real, *stamp)] = value
            self._store(real, stamp, value)
        return value

    # -- the SQLite file --------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection | None:
        if self._db is not None or self._db_failed:
            return self._db
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS digests (path TEXT PRIMARY KEY, dev INTEGER, ino INTEGER, "
                       "size INTEGER, mtime_ns INTEGER, sha256 TEXT NOT NULL)")
            self._db = db
        except (OSError, sqlite3.Error) as err:
            self._db_failed = True
            log.warning("digest memo %s unusable (%s): file digests are computed but not remembered",
                        self.path, err)
        return self._db

    def _lookup(self, real: str, stamp: tuple) -> str | None:
        with self._lock:
            db = self._connect()
            if db is None:
                return None
            try:
                row = db.execute("SELECT dev, ino, size, mtime_ns, sha256 FROM digests WHERE path = ?",
                                 (real,)).fetchone()
            except sqlite3.Error as err:
                log.warning("digest memo %s: lookup failed (%s)", self.path, err)
                return None
        return row[4] if row is not None and tuple(row[:4]) == stamp else None

    def _store(self, real: str, stamp: tuple, value: str) -> None:
        with self._lock:
            db = self._connect()
            if db is None:
                return
            try:
                db.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?)", (real, *stamp, value))
            except sqlite3.Error as err:  # locked past the timeout, disk full: only the memo suffers
                log.warning("digest memo %s: could not remember %s (%s)", self.path, real, err)


_memo: DigestMemo | None = None
_memo_owner: tuple[int, str] | None = None


def memo() -> DigestMemo:
    """This process's memo (a new one after fork, or when SPLITFLOW_CACHE_DIR changes)."""
    global _memo, _memo_owner
    owner = (os.getpid(), str(memo_dir()))
    if _memo is None or _memo_owner != owner:
        _memo, _memo_owner = DigestMemo(), owner
    return _memo


def file_digest(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file's bytes; remembered across runs while the file is unchanged."""
    return memo().digest(path)
