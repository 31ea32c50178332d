"""zarr backend: each part is one sharded 1-D byte array, entries laid out back to back.

Why this layout: one read call per entry (zarr costs ~2 ms per call, so per-tensor arrays would
cost several), a few files per thousand entries (32 MiB shards), every dtype bit-exact (bytes +
manifest, see codec.py; zarr itself has no bfloat16), and each part has exactly one writer, so
no shard is ever read-modify-written by two processes.  Works on any fsspec URL (s3://...).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zarr
from zarr.codecs import ZstdCodec
from zarr.errors import ContainsGroupError

from ._fs import Root
from .base import CacheFormatError, Entry
from .codec import align, pack_entry, unpack_entry
from .parts import PartStore

PARTS = "parts"
CHUNK_BYTES = 512 * 1024        # decode unit of a random read: ~1 chunk of overhead per entry
SHARD_BYTES = 32 * 1024 * 1024  # one file per 32 MiB: ~30 files per 1,000 entries of 1 MiB


def zarr_store(root: Root, url: str, storage_options: dict | None, read_only: bool):
    if root.local:
        return zarr.storage.LocalStore(root.path, read_only=read_only)
    return zarr.storage.FsspecStore.from_url(url, storage_options=storage_options or {}, read_only=read_only)


class ZarrStore(PartStore):
    backend = "zarr"

    def __init__(self, root: Root, mode: str, fingerprint: str | None, writer: str | None,
                 storage_options: dict | None = None, compression: str | None = "zstd"):
        self._storage_options = storage_options
        self._zstore = zarr_store(root, root.url, storage_options, read_only=(mode == "r"))
        self._compressors = [ZstdCodec(level=1)] if compression == "zstd" else None
        if compression not in ("zstd", None):
            raise ValueError(f"compression must be 'zstd' or None, got {compression!r}")
        self._arrays: dict[str, zarr.Array] = {}
        self._buf = bytearray()  # bytes of the current part not yet written (< one shard)
        self._flushed = 0        # bytes of the current part already in the array
        super().__init__(root, mode, fingerprint, writer)
        if mode != "r":
            try:
                zarr.open_group(store=self._zstore, mode="a")  # root stays a valid zarr hierarchy
            except ContainsGroupError:
                pass  # a concurrent writer created it between zarr's check and its write

    def _after_fork(self) -> None:
        self._zstore = zarr_store(self._root, self.url, self._storage_options, read_only=(self.mode == "r"))
        self._arrays = {}

    def _start_part(self, part: str) -> None:
        self._reconnect_if_forked()
        self._arrays[part] = zarr.create_array(
            store=self._zstore, name=f"{PARTS}/{part}", shape=(0,), dtype="uint8",
            chunks=(CHUNK_BYTES,), shards=(SHARD_BYTES,), compressors=self._compressors,
            fill_value=0, config={"write_empty_chunks": True},  # so every shard exists as a file
            attributes={"splitflow": "entries back to back; see manifests/" + part + ".json"})
        self._buf, self._flushed = bytearray(), 0

    def _write_entry(self, part: str, key: str, entry: Entry) -> dict[str, Any]:
        blob, record = pack_entry(key, entry)
        pos = self._flushed + len(self._buf)
        self._buf.extend(bytes(align(pos) - pos))
        record["offset"] = self._flushed + len(self._buf)
        self._buf.extend(blob)
        while len(self._buf) >= SHARD_BYTES:  # whole shards only: no read-modify-write
            self._flush(SHARD_BYTES)
        return record

    def _flush(self, n: int) -> None:
        arr = self._arrays[self._part]
        arr.resize((self._flushed + n,))
        arr[self._flushed: self._flushed + n] = np.frombuffer(self._buf, dtype=np.uint8, count=n)
        del self._buf[:n]
        self._flushed += n

    def _finish_part(self, part: str) -> None:
        if self._buf:
            self._flush(len(self._buf))
        shards = -(-self._flushed // SHARD_BYTES)
        if len(self.root.listdir(f"{PARTS}/{part}/c")) != shards:  # never publish a manifest without data
            raise CacheFormatError(
                f"cache {self.url}: part {part} vanished before its commit (did a second process run with "
                f"writer id {self.writer!r} and remove it as dead?); its entries were not committed")

    def _array(self, part: str) -> zarr.Array:
        self._reconnect_if_forked()
        if part not in self._arrays:
            self._arrays[part] = zarr.open_array(store=self._zstore, path=f"{PARTS}/{part}", mode="r")
        return self._arrays[part]

    def _read_entry(self, part: str, key: str, record: dict[str, Any]) -> Entry:
        arr = self._array(part)
        off, n = int(record["offset"]), int(record["nbytes"])
        if off + n > arr.shape[0]:
            buf = np.zeros(0, np.uint8)  # the part is shorter than its manifest says
        else:
            buf = arr[off: off + n] if n else np.zeros(0, np.uint8)
        return unpack_entry(f"cache {self.url}: entry {key} (part {part})", np.ascontiguousarray(buf), record)

    def _data_parts(self) -> list[str]:
        return self.root.listdir(PARTS)

    def _remove_part_data(self, part: str) -> None:
        self._arrays.pop(part, None)
        self.root.remove(f"{PARTS}/{part}")

    def _part_mtime(self, part: str) -> float | None:
        return self.root.modified(f"{PARTS}/{part}/zarr.json")
