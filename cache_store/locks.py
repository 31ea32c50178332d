"""One writer at a time: locks that live beside what they guard and name their holder.

An output folder (one training run) and a cache part (one preprocessing writer id) each have a
single writer.  A second one is refused with :class:`LockHeldError` naming the holder (pid,
host, since when).  A holder that died must never block the next run, so two mechanisms,
chosen by where the guarded thing lives:

* **local folders**: ``flock(2)`` on a small file.  The kernel drops the lock when its holder
  dies (SIGKILL included), so a dead holder is taken over at once and two takers cannot both
  win; the file's text only names the holder.  (On NFS, Linux maps flock to byte-range locks,
  whose server-side lease expires when a client host disappears.)
* **object stores** (``s3://``): a lease object the holder renews from a heartbeat thread.
  Every write is conditional on the object's ETag (create: ``If-None-Match: *``; renew and
  take-over: ``If-Match``), so of two processes taking over a stale lease exactly one wins, and
  a holder that lost its lease finds out at its next renewal.  A lease is stale when it was
  not renewed for its ``ttl_s``, or at once when it names a dead pid on this very machine.

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


# -- object stores: a lease with conditional writes ---------------------------------------------
def _precondition_failed(err: BaseException) -> bool:
    """Whether an s3fs error is S3 refusing a conditional write (412, or 409 for a racing one)."""
    seen: BaseException | None = err
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)
        seen = seen.__cause__
    return isinstance(err, FileExistsError)


class LeaseLock:
    """A lease object at ``rel`` under ``root`` (an S3 cache), renewed every ``ttl_s / 3`` s."""

    def __init__(self, root: Root, rel: str, what: str, ttl_s: float = LEASE_TTL_S):
        self.root, self.what, self.ttl_s = root, what, ttl_s
        self.where = f"{root.url.rstrip('/')}/{rel}"
        self._bucket, self._key, _ = root.fs.split_path(root.full(rel))
        self._record: dict[str, Any] | None = None
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # why the lease was lost, once it is

    # storage: three conditional calls and a read
    def _put(self, record: dict[str, Any], **condition: str) -> str | None:
        try:
            out = self.root.fs.call_s3("put_object", Bucket=self._bucket, Key=self._key,
                                       Body=json.dumps(record).encode(), **condition)
        except OSError as err:
            if _precondition_failed(err):
                return None
            raise
        return out["ETag"]

    def _get(self) -> tuple[dict[str, Any] | None, str] | None:
        from fsspec.asyn import sync

        async def read():
            try:
                out = await self.root.fs._call_s3("get_object", Bucket=self._bucket, Key=self._key)
            except FileNotFoundError:
                return None
            return _parse(await out["Body"].read()), out["ETag"]

        return sync(self.root.fs.loop, read)

    def _stale(self, record: dict[str, Any] | None) -> bool:
        if record is None:
            return True  # unreadable: nobody can be told apart from it, so nobody holds it
        if record.get("machine") == machine_id():
            return not pid_alive(int(record.get("pid", -1)), record.get("pid_start", ""))
        return time.time() - float(record.get("renewed_at", 0)) > float(record.get("ttl_s", self.ttl_s))

    def acquire(self) -> None:
        record = holder_record(self.what, self.ttl_s)
        for _ in range(5):  # each round either wins, or meets a live holder, or saw a race
            etag = self._put(record, IfNoneMatch="*")
            if etag is None:
                current = self._get()
                if current is None:
                    continue  # released between our two calls: try to create again
                held, held_etag = current
                if held and held.get("token") == record["token"]:
                    etag = held_etag  # our own create succeeded, its reply was lost and retried
                elif not self._stale(held):
                    raise LockHeldError(describe_holder(self.what, held, self.where))
                else:
                    etag = self._put(record, IfMatch=held_etag)
                    if etag is None:
                        continue  # another process took it over first: look again
                    log.warning("took over the stale lock %s of pid %s on %s", self.where,
                                (held or {}).get("pid"), (held or {}).get("host"))
            self._record, self._etag = record, etag
            self._thread = threading.Thread(target=self._heartbeat, name="splitflow-lease", daemon=True)
            self._thread.start()
            return
        raise LockHeldError(f"{self.what}: could not take lock {self.where} (other processes keep racing for it)")

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            record = {**self._record, "renewed_at": time.time()}
            try:
                etag = self._put(record, IfMatch=self._etag)
            except OSError as err:  # network: keep trying until the lease would have expired
                if time.time() - self._record["renewed_at"] > self.ttl_s:
                    self.lost = f"could not renew it for {self.ttl_s:.0f}s ({err})"
                    log.error("lost lock %s: %s", self.where, self.lost)
                    return
                continue
            if etag is None:
                self.lost = "another process took it over"
                log.error("lost lock %s: %s", self.where, self.lost)
                return
            self._record, self._etag = record, etag

    def verify(self) -> None:
        """Raise if the lease was lost (renewals failed past its ttl, or it was taken over)."""
        if self.lost:
            raise LockHeldError(f"{self.what}: lock {self.where} was lost ({self.lost}); "
                                "this writer stops so that two never write at once")

    def release(self) -> None:
        if self._record is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.lost:
            try:
                self.root.fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key, IfMatch=self._etag)
            except OSError as err:  # taken over meanwhile, or the network is gone: the lease expires
                log.warning("could not release lock %s: %s", self.where, err)
        self._record = None


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
