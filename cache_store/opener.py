"""open_cache: find (or create) a cache at a URL and hand back the right backend.

The header file ``splitflow-cache.json`` is written once, at creation, and records the backend,
the model family and the encoders' fingerprint (a digest of their weights' content).  A writer
or a reader that names other encoders is refused, naming both, so entries encoded by one model
are never mixed with, or trained on by, another.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ._fs import Root
from .base import CacheFormatError, CacheStore
from .locks import LOCKS
from .pth_backend import PthStore
from .zarr_backend import ZarrStore

HEADER = "splitflow-cache.json"
FORMAT, VERSION = "splitflow-cache", 1
BACKENDS = {"zarr": ZarrStore, "pth": PthStore}


def read_header(root: Root) -> dict[str, Any] | None:
    raw = root.read_bytes(HEADER)
    if raw is None:
        return None
    try:
        header = json.loads(raw)
        assert header["format"] == FORMAT and header["backend"] in BACKENDS
    except Exception as e:
        raise CacheFormatError(f"cache {root.url}: {HEADER} is not a splitflow cache header ({e!r})") from e
    if header.get("version", 0) > VERSION:
        raise CacheFormatError(f"cache {root.url}: format version {header['version']} is newer than "
                               f"this splitflow understands ({VERSION}); upgrade splitflow")
    return header


def looks_like_diffsynth(root: Root) -> bool:
    """DiffSynth-Studio split training writes <rank>/<i>.pth folders and nothing else."""
    ranks = [n for n in root.listdir("") if n.isdigit()]
    return any(any(f.endswith(".pth") for f in root.listdir(r)) for r in ranks[:4])


def _diffsynth_hint(root: Root) -> str:
    if not looks_like_diffsynth(root):
        return ""
    return (" It looks like a DiffSynth-Studio cache: convert it with `splitflow cache import SRC DEST` "
            "(cache_store.diffsynth.import_diffsynth_cache).")


def _create_header(root: Root, backend: str | None, fingerprint: str | None, family: str | None) -> None:
    # a racing creator's temp file, or a writer's part lock taken before the cache existed
    present = [n for n in root.listdir("") if not n.endswith(".partial") and n != LOCKS]
    if HEADER in present:
        return  # a concurrent writer created the cache since we looked
    if present:
        raise CacheFormatError(f"cache {root.url}: folder exists and is not a splitflow cache "
                               f"(no {HEADER}); refusing to write into it.{_diffsynth_hint(root)}")
    backend = backend or "zarr"
    header = {"format": FORMAT, "version": VERSION, "backend": backend,
              "fingerprint": fingerprint, "created_at": time.time()}
    if family is not None:
        header["family"] = family
    try:
        root.write_bytes(HEADER, json.dumps(header, indent=1).encode(), exclusive=True)
    except FileExistsError:
        pass  # a concurrent writer created it first; its header rules (checked by the caller)


def check_identity(url: str, recorded: tuple[str | None, str | None], fingerprint: str | None,
                   family: str | None) -> None:
    """Refuse a cache made by other encoders (or for another family), naming both sides.

    ``recorded``: the cache's (fingerprint, family); a cache made before families were
    recorded has family None and is judged by its fingerprint alone.
    """
    recorded_fingerprint, recorded_family = recorded
    if family is not None and recorded_family is not None and family != recorded_family:
        raise CacheFormatError(
            f"cache {url} holds entries encoded for model family {recorded_family!r} (encoder fingerprint "
            f"{recorded_fingerprint!r}), but this run's model is family {family!r}; point cache.url at another cache or preprocess into a new one")
    if fingerprint is not None and fingerprint != recorded_fingerprint:
        raise CacheFormatError(
            f"cache {url} was encoded by other encoders (encoder fingerprint {recorded_fingerprint!r}) than "
            f"this run's model (encoder fingerprint {fingerprint!r}): their weights differ; point cache.url "
            "at another cache or preprocess into a new one")


def open_cache(url: str | os.PathLike, mode: str = "r", *, backend: str | None = None,
               fingerprint: str | None = None, family: str | None = None, writer: str | None = None,
               storage_options: dict[str, Any] | None = None, compression: str | None = "zstd") -> CacheStore:
    """Open the cache at ``url`` (local path or fsspec URL) for reading ("r") or appending ("a").

    ``backend``: None detects it from disk (zarr when creating).  ``fingerprint`` (the encoders'
    identity) and ``family`` are recorded at creation and checked afterwards.  ``writer``: this
    writer's id; its parts are named after it, and its own uncommitted leftovers from a killed
    run are removed.
    ``compression`` ("zstd" | None) applies to zarr parts written by this store.
    """
    if mode not in ("r", "a"):
        raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or None, got {backend!r}")
    root = Root(os.fspath(url), storage_options)
    header = read_header(root)
    if header is None and mode == "r":
        raise CacheFormatError(f"cache {root.url}: no splitflow cache here (no {HEADER}); "
                               f"run preprocess.{_diffsynth_hint(root)}")
    if header is None:
        _create_header(root, backend, fingerprint, family)
        header = read_header(root)
    if backend is not None and backend != header["backend"]:
        raise CacheFormatError(f"cache {root.url} is a {header['backend']} cache, not {backend}")
    check_identity(root.url, (header["fingerprint"], header.get("family")), fingerprint, family)
    cls = BACKENDS[header["backend"]]
    kwargs = {"storage_options": storage_options, "compression": compression} if cls is ZarrStore else {}
    store = cls(root, mode, header["fingerprint"], writer, **kwargs)
    store.family = header.get("family")
    if mode == "a" and writer is not None:
        store._drop_own_orphans()
    return store
