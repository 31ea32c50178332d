"""One writer at a time: locks that live beside what they guard and name their holder.

An output folder (one training run) and a cache part (one preprocessing writer id) each have a
single writer.  A second one is refused with :class:`LockHeldError` naming the holder (pid,
host, since when).  A holder that died must never block the next run, so two mechanisms,
chosen by where the guarded thing lives:

* **local folders**: ``flock(2)`` on a small file.  The kernel drops the lock when its holder
  dies (SIGKILL included), so a dead holder is taken over at once and two takers cannot both
  win; the file's text only names the holder.  (On NFS, Linux maps flock to byte-range locks,
  whose server-side lease expires when a client host disappears.)
* **object stores** (``s3://``): a lease renewed by a heartbeat and changed only by writes
  conditional on its ETag (``leases.py``).

Locks are re-entrant within a process (a flow that holds an output folder can call the stage
that takes the same lock).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Iterator

from diffsynth_core.errors import LockHeldError

from ._fs import Root

log = logging.getLogger(__name__)

LOCKS = "locks"          # folder of part locks inside a cache
LEASE_TTL_S = 60.0       # a lease not renewed for this long is stale
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


# -- who we are -------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def machine_id() -> str:
    """This boot of this machine, in this pid namespace: where a pid means the same process."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return f"{socket.gethostname()}/{boot}/{pid_ns}"


def _process_start(pid: int) -> str:
    """Start time of ``pid`` (clock ticks since boot) so a reused pid is not mistaken for it."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def pid_alive(pid: int, start: str = "") -> bool:
    """Whether ``pid`` runs on this machine (a zombie or a reused pid counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _read(f"/proc/{pid}/stat")
    if stat and stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
        return False
    return not start or not stat or _process_start(pid) == start


def holder_record(what: str, ttl_s: float | None = None) -> dict[str, Any]:
    now = time.time()
    record = {"what": what, "pid": os.getpid(), "host": socket.gethostname(), "machine": machine_id(),
              "pid_start": _process_start(os.getpid()), "since": now, "renewed_at": now,
              "token": uuid.uuid4().hex}
    if ttl_s is not None:
        record["ttl_s"] = ttl_s
    return record


def describe_holder(what: str, record: dict[str, Any] | None, where: str) -> str:
    if not record:
        return f"{what} is in use by another process (lock {where}, holder not recorded yet); try again shortly"
    since = datetime.fromtimestamp(record.get("since", 0)).strftime("%Y-%m-%d %H:%M:%S")
    return (f"{what} is in use by pid {record.get('pid')} on {record.get('host')} since {since} "
            f"(lock {where}); wait for it to finish or stop that process, then re-run")


# -- local folders: flock -----------------------------------------------------------------------
class FileLock:
    """``flock`` on ``path``; the file's content names the holder (see the module docstring)."""

    def __init__(self, path: str, what: str):
        self.path, self.what = path, what
        self._fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse(os.pread(fd, 4096, 0))
            os.close(fd)
            raise LockHeldError(describe_holder(self.what, holder, self.path)) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_FLOCK:
                raise
            log.warning("%s: this file system has no locks (%s); a second writer would not be refused",
                        self.path, err.strerror)
            return
        data = json.dumps(holder_record(self.what)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._fd = fd

    def verify(self) -> None:
        """A kernel lock cannot be lost while its holder lives."""

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # never unlink: a waiter could lock the unlinked file
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    try:
        record = json.loads(raw or b"")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


# -- one entry point --------------------------------------------------------------------------
_held: dict[str, list] = {}  # lock id -> [lock, depth] for re-entry within this process
_held_guard = threading.Lock()


class _Unguarded:
    """File systems with neither flock nor conditional writes (memory://, ...): warn, do not lock."""

    def __init__(self, where: str):
        log.warning("%s: no locks on this file system; a second writer would not be refused", where)

    def acquire(self) -> None: ...
    def verify(self) -> None: ...
    def release(self) -> None: ...


def make_lock(root: Root, rel: str, what: str, ttl_s: float = LEASE_TTL_S):
    if root.local:
        return FileLock(root.full(rel), what)
    if "s3" in root.fs.protocol or "s3a" in root.fs.protocol:
        from .leases import LeaseLock

        return LeaseLock(root, rel, what, ttl_s)
    return _Unguarded(root.full(rel))


@contextmanager
def hold(url: str, rel: str, what: str, *, storage_options: dict | None = None,
         ttl_s: float = LEASE_TTL_S) -> Iterator[Any]:
    """Hold the lock at ``rel`` under ``url`` for the block; ``what`` names the guarded thing.

    Raises :class:`LockHeldError` (exit code 3, retryable) naming the live holder.  Yields the
    lock; long writers call ``lock.verify()`` before publishing work.
    """
    root = Root(str(url), storage_options)
    ident = f"{root.fs.protocol}:{root.full(rel)}@{os.getpid()}"
    with _held_guard:
        entry = _held.get(ident)
        if entry is not None:
            entry[1] += 1
    if entry is None:
        lock = make_lock(root, rel, what, ttl_s)
        lock.acquire()
        with _held_guard:
            entry = _held.setdefault(ident, [lock, 0])
            entry[1] += 1
    try:
        yield entry[0]
    finally:
        with _held_guard:
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                _held.pop(ident, None)
        if last:
            entry[0].release()
