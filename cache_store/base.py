"""The stage-1 cache seam: one small protocol, two backends (zarr, pth).

Why a seam: preprocessing machines write entries, the training machine reads them, and the
two never share a process.  Everything they agree on goes through this protocol, so the
storage format can change without touching either stage.

An *entry* is ``dict[str, Tensor]`` plus an optional ``"meta"`` key holding a small JSON-able
dict (height, width, prompt, source row ...).  A *key* is a content fingerprint (see
``cache_store.keys``).  Entries become visible to readers only once the part that holds them
is committed; a writer killed before ``commit`` leaves nothing visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from diffsynth_core.errors import InputError

Entry = dict[str, Any]  # str -> Tensor, plus "meta" -> dict


@dataclass
class VerifyReport:
    checked: int = 0
    errors: list[str] = field(default_factory=list)   # each names the entry (and part/file)
    missing: list[str] = field(default_factory=list)  # dataset keys with no committed entry

    @property
    def ok(self) -> bool:
        return not self.errors and not self.missing


class IncompleteCacheError(InputError):
    """Training was asked to read a cache that lacks entries the dataset needs (exit code 2)."""


class CacheFormatError(InputError):
    """A file or entry in the cache is unreadable, tampered with or disagrees with its manifest (exit code 2)."""


@runtime_checkable
class CacheStore(Protocol):
    url: str
    fingerprint: str | None  # preprocessing fingerprint the store was created with

    def keys(self) -> list[str]: ...                      # committed entries, stable order
    def has(self, key: str) -> bool: ...
    def get(self, key: str) -> Entry: ...
    def shapes(self, key: str) -> dict[str, tuple[int, ...]]: ...  # tensor shapes, no data read
    def put(self, key: str, entry: Entry) -> None: ...    # buffered until commit()
    def commit(self) -> None: ...                         # atomically publish buffered entries
    def put_skipped(self, key: str, info: dict) -> None: ...  # a bad row skipped (row, file, reason)
    def skipped(self) -> dict[str, dict]: ...             # committed skip records by key
    def verify(self) -> VerifyReport: ...
    def stats(self) -> dict[str, Any]: ...
    def set_dataset_keys(self, keys: Iterable[str]) -> None: ...  # what the current dataset needs
    def dataset_keys(self) -> list[str] | None: ...
    def missing_keys(self) -> list[str]: ...              # dataset keys not yet committed
    def require_complete(self, allow_partial: bool = False) -> list[str]: ...  # keys to train on
    def refresh(self) -> None: ...                        # re-read manifests other writers committed
    def cleanup(self, min_age_s: float = 3600.0) -> list[str]: ...  # remove dead writers' leftovers


def tensor_nbytes(entry: Entry) -> int:
    return sum(v.numel() * v.element_size() for v in entry.values() if isinstance(v, torch.Tensor))
