"""A lock on an object store (``s3://``): a lease renewed by a heartbeat, changed only by conditional writes.

Object stores have no flock, so the holder writes a lease object naming itself and renews it
every ``ttl_s / 3`` seconds from a thread.  Every write is conditional on the object's ETag
(create: ``If-None-Match: *``; renew and take-over: ``If-Match``), so of two processes taking
over a stale lease exactly one wins, and a holder that lost its lease finds out at its next
renewal (``verify()`` then raises; stores call it before each commit).  A lease is stale when
it was not renewed for its ``ttl_s``, or at once when it names a dead pid on this machine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from diffsynth_core.errors import LockHeldError

from ._fs import Root
from .locks import LEASE_TTL_S, _parse, describe_holder, holder_record, machine_id, pid_alive

log = logging.getLogger(__name__)


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
                self._delete_own()
            except OSError as err:  # the network is gone: the lease expires by itself
                log.warning("could not release lock %s: %s", self.where, err)
        self._record = None

    def _delete_own(self) -> None:
        try:
            self.root.fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key, IfMatch=self._etag)
        except OSError as err:
            if _precondition_failed(err):
                return  # taken over meanwhile: the lease is someone else's now
            current = self._get()  # a store without conditional deletes: delete it if still ours
            if current is not None and current[0] and current[0].get("token") == self._record["token"]:
                self.root.fs.call_s3("delete_object", Bucket=self._bucket, Key=self._key)
