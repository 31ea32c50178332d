"""Test helpers over the demo dataset's metadata.csv (rows cut, edited, repeated) and a cache's entries."""

from __future__ import annotations

import csv

from cache_store import open_cache


def rewrite_metadata(cfg, edit) -> None:
    """Replace the rows of ``cfg``'s metadata.csv with ``edit(rows)`` (dicts with image and prompt)."""
    path = cfg.dataset.metadata_path
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    rows = edit(rows)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)


def keep_rows(cfg, count: int) -> None:
    """Cut the demo metadata to its first ``count`` rows (tests stay fast)."""
    rewrite_metadata(cfg, lambda rows: rows[:count])


def cached_entries(url) -> dict:
    """Every entry of the (complete) cache at ``url``, by key."""
    store = open_cache(url, mode="r")
    return {key: store.get(key) for key in store.require_complete()}
