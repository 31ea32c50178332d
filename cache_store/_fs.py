"""Small-file access to a cache root on any fsspec filesystem (local disk, s3://, memory://).

Why: the commit protocol needs three things from storage, identical on a laptop and on S3:
write a small file atomically, read it back, list a folder.  Locally "atomic" means temp file +
fsync + rename; on an object store a single PUT is already all-or-nothing.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


class Root:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url, self.storage_options = url, storage_options
        try:
            self.fs, self.path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as err:  # fsspec knows the protocol, its package is not installed here
            from diffsynth_core.errors import EnvironmentFailure

            raise EnvironmentFailure(f"cache {url}: {err} (pip install it where this runs, e.g. s3fs for s3://)",
                                     retryable=False) from None
        self.path = self.path.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def reopen(self) -> "Root":
        """A fresh connection (fsspec drops its cached instances in a forked child)."""
        return Root(self.url, self.storage_options)

    def full(self, rel: str) -> str:
        return f"{self.path}/{rel}" if rel else self.path

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.full(rel))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def write_bytes(self, rel: str, data: bytes, exclusive: bool = False) -> None:
        """Readers see the old file or the whole new one, never a torn one.

        ``exclusive``: raise FileExistsError instead of replacing (atomic locally; on object
        stores a check-then-put, good enough for the one-time cache header).
        """
        target = self.full(rel)
        if not self.local:
            if exclusive and self.exists(rel):
                raise FileExistsError(target)
            self.fs.pipe_file(target, data)
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.{uuid.uuid4().hex[:12]}.partial"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                os.link(tmp, target)  # fails if target exists: create-if-absent, atomically
            else:
                os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under ``rel``; [] when the folder does not exist."""
        path = self.full(rel)
        self.fs.invalidate_cache(path)  # s3fs caches listings; other writers add files
        try:
            items = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in items if p.rstrip("/") != path)

    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache(self.full(rel))
        return self.fs.exists(self.full(rel))

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm(self.full(rel), recursive=True)
        except FileNotFoundError:
            pass

    def files(self) -> dict[str, int]:
        """Every file under the root (relative path -> size in bytes)."""
        self.fs.invalidate_cache(self.path)
        try:
            found = self.fs.find(self.path, detail=True)
        except FileNotFoundError:
            return {}
        n = len(self.path) + 1
        return {p[n:]: int(info.get("size") or 0) for p, info in found.items()}

    def modified(self, rel: str) -> float | None:
        """Modification time (epoch seconds) or None where the filesystem does not say."""
        try:
            m = self.fs.modified(self.full(rel))
        except (FileNotFoundError, NotImplementedError, IsADirectoryError):
            return None
        return m.timestamp()
