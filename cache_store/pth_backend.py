"""pth backend: one safetensors file per entry, committed through the same manifests.

Why safetensors rather than pickled ``torch.save``: loading it never runs code, the header
states dtype and shape (checked against the manifest), and bf16 is native.  One file per
sample (not per tensor) is simplest and fastest for local disks up to ~100k samples; beyond
that prefer the zarr backend.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .base import CacheFormatError, Entry
from .codec import check_record, check_tensor_spec, dtype_name, spec_crc, split_entry
from .parts import PartStore

ENTRIES = "entries"


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """safetensors refuses tensors that share storage (e.g. DiffSynth's noise is latents)."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


class PthStore(PartStore):
    backend = "pth"

    def _write_entry(self, part: str, key: str, entry: Entry) -> dict[str, Any]:
        tensors, meta = split_entry(key, entry)
        try:
            raw = st_save({k: _own_storage(v) for k, v in tensors.items()},
                          metadata={"splitflow_meta": json.dumps(meta)})
        except Exception as e:
            raise TypeError(f"entry {key}: cannot be stored as safetensors: {e}") from e
        rel = f"{ENTRIES}/{key[:2]}/{key}.safetensors"
        self.root.write_bytes(rel, raw)  # atomic; invisible until the manifest names it
        specs = {k: {"dtype": dtype_name(t), "shape": list(t.shape)} for k, t in tensors.items()}
        record = {"file": rel, "nbytes": len(raw), "crc32": zlib.crc32(raw), "tensors": specs, "meta": meta}
        record["spec_crc32"] = spec_crc(record)
        return record

    def _read_entry(self, part: str, key: str, record: dict[str, Any]) -> Entry:
        where = f"cache {self.url}: entry {key} (file {record['file']})"
        check_record(where, record)
        raw = self.root.read_bytes(record["file"])
        if raw is None:
            raise CacheFormatError(f"{where}: file is missing")
        if len(raw) != record["nbytes"] or zlib.crc32(raw) != record["crc32"]:
            raise CacheFormatError(f"{where}: {len(raw)} bytes, manifest says {record['nbytes']}; "
                                   "checksum mismatch (file truncated or tampered with)")
        tensors = st_load(raw)
        if set(tensors) != set(record["tensors"]):
            raise CacheFormatError(f"{where}: file holds fields {sorted(tensors)}, "
                                   f"manifest says {sorted(record['tensors'])}")
        for name, t in tensors.items():
            check_tensor_spec(where, name, t, record["tensors"][name])
        out: Entry = dict(tensors)
        out["meta"] = dict(record.get("meta") or {})
        return out

    def _junk_files(self) -> list[str]:
        """Temp files, and entry files no manifest names (their writer died before commit)."""
        named = {rec["file"] for _, rec in self._index.values()} | {r["file"] for r in self._pending.values()}
        return [rel for rel in self.root.files() if rel.endswith(".partial")
                or (rel.startswith(f"{ENTRIES}/") and rel.endswith(".safetensors") and rel not in named)]
