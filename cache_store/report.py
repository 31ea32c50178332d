"""`splitflow cache inspect|verify PATH`: what is in a cache, as a dict and as text."""

from __future__ import annotations

from typing import Any

from ._fs import Root
from .base import CacheFormatError
from .opener import looks_like_diffsynth, open_cache

MAX_LISTED = 10  # errors / missing keys shown in the text report


def inspect_cache(url: str, *, verify: bool = False, storage_options: dict | None = None,
                  allow_nonfinite: bool = False) -> dict[str, Any]:
    """Stats of the cache at ``url``; with ``verify`` also read every entry.

    ``ok`` is False when the cache cannot be opened, or (verify) when an entry is bad or a
    dataset key has no entry.
    """
    url = str(url)
    try:
        store = open_cache(url, "r", storage_options=storage_options)
    except CacheFormatError as e:
        info: dict[str, Any] = {"url": url, "ok": False, "error": str(e)}
        root = Root(url, storage_options)
        if looks_like_diffsynth(root):
            info["kind"] = "diffsynth"
            info["files"] = sum(len([f for f in root.listdir(r) if f.endswith(".pth")])
                                for r in root.listdir("") if r.isdigit())
        return info
    info = {"kind": "splitflow", **store.stats(), "verified": verify}
    info["ok"] = info["dataset_keys_error"] is None  # a corrupt dataset-keys.json is reported, not raised
    info["missing_examples"] = store.missing_keys()[:MAX_LISTED] if info["ok"] else []
    if verify:
        report = store.verify(allow_nonfinite=allow_nonfinite)
        info.update(ok=report.ok, checked=report.checked, errors=report.errors)
    return info


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _aux(info: dict[str, Any]) -> str:
    """Entries that are no dataset row: the empty prompt's embedding, which caption dropout trains with."""
    n = info["aux_entries"]
    return f"{n} auxiliary: the empty prompt's embedding, for caption dropout" if n == 1 else f"{n} auxiliary"


def format_inspect(info: dict[str, Any]) -> str:
    if "error" in info:
        lines = [info['error']]
        if info.get("kind") == "diffsynth":
            lines.append(f"  DiffSynth-Studio split-training cache with {info['files']} .pth files")
        return "\n".join(lines)
    complete = {True: "complete", False: "INCOMPLETE", None: "each config's rows: splitflow status CONFIG"}
    lines = [
        f"cache        {info['url']}",
        f"backend      {info['backend']}",
        f"fingerprint  {info['fingerprint']}",
        f"entries      {info['entries']} in {info['parts']} parts"
        + (f" ({info['duplicates']} duplicate copies)" if info["duplicates"] else "")
        + (f", plus {_aux(info)}" if info.get("aux_entries") else ""),
        f"size         {_size(info['bytes'])} in {info['files']} files "
        f"({_size(info['tensor_bytes'])} of entries)",
        f"dataset      {info['dataset_keys'] if info['dataset_keys'] is not None else '-'} keys, "
        f"{info['missing']} missing: {complete[info['complete']]}",
    ]
    if info.get("dataset_keys_error"):
        lines[-1] = f"dataset      UNREADABLE: {info['dataset_keys_error']} (re-run preprocess to rewrite it)"
    if info["bad_parts"]:
        lines.append(f"bad parts    {len(info['bad_parts'])} unreadable manifests: {', '.join(info['bad_parts'][:3])}")
    if info["orphan_parts"]:
        lines.append(f"orphans      {info['orphan_parts']} uncommitted parts (killed or running writers)")
    lines += [f"  missing: {k}" for k in info.get("missing_examples", [])]
    if info.get("verified"):
        errors = info["errors"]
        aux = f" ({info['entries']} entries + {info['aux_entries']} auxiliary read)" if info.get("aux_entries") else ""
        lines.append(f"verify       {info['checked']} entries read, {len(errors)} bad, "
                     f"{info['missing']} missing: " + ("OK" if info["ok"] else "FAILED") + aux)
        lines += [f"  {e}" for e in errors[:MAX_LISTED]]
        if len(errors) > MAX_LISTED:
            lines.append(f"  ... and {len(errors) - MAX_LISTED} more")
    return "\n".join(lines)
