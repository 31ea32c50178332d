"""Content fingerprints: what makes two cache entries the same.

A key hashes everything that changes an encoded entry: the sample's metadata fields, the bytes
of the files it names, and the preprocessing settings (resolution rules, max tokens, frames and
the encoders' identity).  Changing any of them changes the key, so a stale entry can never be
served for a changed sample; changing nothing reuses the entry, whoever wrote it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Iterable

from . import digests

KEY_HEX_CHARS = 32  # 128 bits: collisions are out of reach for any realistic dataset


def _canonical(obj: Any, where: str) -> Any:
    """Normalise to plain JSON types so equal content always serialises identically."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        # pandas turns blank CSV cells into NaN; treat them as "no value" rather than failing
        return None if math.isnan(obj) else obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a string")
            out[k] = _canonical(v, f"{where}.{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):  # numpy / torch scalars
        return _canonical(obj.item(), where)
    raise TypeError(f"{where}: value of type {type(obj).__name__} is not JSON-able")


def canonical_json(obj: Any, where: str = "value") -> str:
    """Sorted keys, no whitespace, UTF-8 kept: one string per value, stable across runs."""
    return json.dumps(_canonical(obj, where), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint_of(obj: Any) -> str:
    """Stable hash of a JSON-able object (dict key order does not matter)."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()[:KEY_HEX_CHARS]


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, remembered across runs while the file is unchanged (see digests)."""
    try:
        return digests.file_digest(path)
    except OSError as e:
        raise FileNotFoundError(f"entry_key: cannot read file {os.fspath(path)!r}: {e}") from e


def entry_key(fields: dict, files: Iterable[str | os.PathLike], settings: dict) -> str:
    """Content key of one sample: its fields (JSON), its files' bytes, the preprocessing settings.

    File *names* enter only through ``fields``; ``files`` contributes their content, in order.
    """
    doc = {
        "fields": _canonical(fields, "fields"),
        "files": [file_digest(f) for f in files],
        "settings": _canonical(settings, "settings"),
    }
    return fingerprint_of(doc)
