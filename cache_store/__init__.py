"""splitflow's stage-1 cache: content-keyed, crash-safe, shareable entries (see base.py)."""

from .base import CacheFormatError, CacheStore, Entry, IncompleteCacheError, VerifyReport
from .keys import entry_key, fingerprint_of
from .opener import open_cache
from .parts import AUX_PREFIX

__all__ = [
    "AUX_PREFIX", "CacheFormatError", "CacheStore", "Entry", "IncompleteCacheError", "VerifyReport",
    "entry_key", "fingerprint_of", "open_cache",
]
