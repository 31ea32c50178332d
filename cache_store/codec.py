"""One entry <-> one contiguous byte string plus a JSON record that says how to read it back.

Why raw bytes: every torch dtype (bfloat16, float8, bool ...) round-trips bit-exact, whatever
the storage format supports natively; the record (dtype, shape, offset, crc32) is the manifest
line that a reader checks before it trusts the bytes.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import numpy as np
import torch

from .base import CacheFormatError, Entry
from .keys import canonical_json

ALIGN = 64  # every tensor starts 64-byte aligned, so a view as any dtype is legal
KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # keys become file names
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"dtype {t.dtype} is not supported by the cache")
    return name


def dtype_from_name(name: str, where: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CacheFormatError(f"{where}: unknown dtype {name!r} in the manifest")
    return _DTYPES[name]


def split_entry(key: str, entry: Entry) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Check a put() argument and return (cpu contiguous tensors, JSON-able meta)."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise ValueError(f"cache key {key!r} must match {KEY_RE.pattern} (use entry_key())")
    if not isinstance(entry, dict):
        raise TypeError(f"entry {key}: expected a dict of tensors, got {type(entry).__name__}")
    meta = entry.get("meta", {})
    if not isinstance(meta, dict):
        raise TypeError(f"entry {key}: 'meta' must be a dict, got {type(meta).__name__}")
    meta = json.loads(canonical_json(meta, f"entry {key} meta"))
    tensors = {}
    for name, value in entry.items():
        if name == "meta":
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"entry {key}: field {name!r} is a {type(value).__name__}, not a tensor "
                            "(put scalars and strings in 'meta')")
        try:
            dtype_name(value)
        except TypeError as e:
            raise TypeError(f"entry {key}: field {name!r}: {e}") from None
        tensors[name] = value.detach().to("cpu").contiguous()
    return tensors, meta


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def pack_entry(key: str, entry: Entry) -> tuple[bytearray, dict[str, Any]]:
    """Lay the tensors out back to back (aligned) and describe them in a manifest record."""
    tensors, meta = split_entry(key, entry)
    specs, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        specs[name] = {"dtype": dtype_name(t), "shape": list(t.shape), "offset": offset, "nbytes": nbytes}
        offset = align(offset + nbytes)
    buf = bytearray(offset)
    view = np.frombuffer(buf, dtype=np.uint8) if offset else np.zeros(0, np.uint8)
    for name, t in tensors.items():
        s = specs[name]
        view[s["offset"]: s["offset"] + s["nbytes"]] = tensor_bytes(t)
    record = {"nbytes": offset, "crc32": zlib.crc32(buf), "tensors": specs, "meta": meta}
    record["spec_crc32"] = spec_crc(record)
    return buf, record


def spec_crc(record: dict[str, Any]) -> int:
    """Checksum of what a manifest line says about an entry (dtypes, shapes, layout, meta)."""
    said = {k: record.get(k) for k in ("nbytes", "crc32", "tensors", "meta")}
    return zlib.crc32(canonical_json(said).encode())


def check_record(where: str, record: dict[str, Any]) -> None:
    """A manifest line edited after the fact (dtype, shape, meta) no longer matches its checksum."""
    if record.get("spec_crc32") != spec_crc(record):
        raise CacheFormatError(f"{where}: manifest record was altered after writing "
                               "(dtype, shape or meta disagree with what was written)")


def unpack_entry(where: str, buf: np.ndarray, record: dict[str, Any]) -> Entry:
    """Rebuild tensors from ``buf`` after checking length, checksum and every spec."""
    check_record(where, record)
    if buf.size != record["nbytes"]:
        raise CacheFormatError(f"{where}: expected {record['nbytes']} bytes, read {buf.size} (truncated?)")
    if zlib.crc32(buf) != record["crc32"]:
        raise CacheFormatError(f"{where}: checksum mismatch (file truncated or tampered with)")
    base = torch.from_numpy(buf) if buf.size else torch.zeros(0, dtype=torch.uint8)
    out: Entry = {}
    for name, s in record["tensors"].items():
        dtype = dtype_from_name(s["dtype"], f"{where} field {name!r}")
        shape = [int(d) for d in s["shape"]]
        expected = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        off, n = int(s["offset"]), int(s["nbytes"])
        if n != expected or off % ALIGN or off + n > buf.size:
            raise CacheFormatError(f"{where} field {name!r}: manifest says {s['dtype']}{shape} "
                                   f"but records {n} bytes at offset {off}")
        out[name] = base[off: off + n].view(dtype).reshape(shape)
    out["meta"] = dict(record.get("meta") or {})
    return out


def check_tensor_spec(where: str, name: str, t: torch.Tensor, spec: dict[str, Any]) -> None:
    """A tensor read from a self-describing file must agree with the manifest line."""
    if dtype_name(t) != spec["dtype"] or list(t.shape) != [int(d) for d in spec["shape"]]:
        raise CacheFormatError(f"{where} field {name!r}: file holds {dtype_name(t)}{list(t.shape)}, "
                               f"manifest says {spec['dtype']}{list(spec['shape'])}")
