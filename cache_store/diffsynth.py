"""Bring a DiffSynth-Studio split-training cache (``<rank>/<i>.pth``) into a splitflow cache.

Those files are pickled ``(inputs_shared, inputs_posi, inputs_nega)`` tuples holding tensors,
plain values, a ``torch.device`` and a PIL image.  ``torch.load(weights_only=False)`` would run
any code the pickle names, so we unpickle with an allow-list: torch's tensor rebuilders, dtypes,
devices and containers are built; PIL images become inert placeholders (never constructed, then
dropped); any other global (``os.system``, ``builtins.eval`` ...) stops the load with an error
naming the file.  The import copies tensors into a new cache keyed by file content.
"""

from __future__ import annotations

import os
import pickle
import types
from pathlib import Path
from typing import Any, Mapping

import torch

from .base import CacheFormatError, Entry
from .keys import entry_key
from .opener import open_cache

_BUILD = {
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch", "device"), ("torch", "Size"),
    ("collections", "OrderedDict"), ("_codecs", "encode"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "complex"),
}
_INERT_MODULES = ("PIL.",)  # data-only classes we skip without constructing them


class Skipped:
    """Stands in for an object we refuse to construct; it keeps nothing and runs nothing."""

    qualname = "?"

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _BUILD:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_INERT_MODULES):
            return type(name, (Skipped,), {"qualname": f"{module}.{name}"})
        raise pickle.UnpicklingError(f"pickle wants {module}.{name}; refusing to run it (only tensors "
                                     "and plain values are read from DiffSynth caches)")


def _safe_load(f, **kwargs):
    return _SafeUnpickler(f, **kwargs).load()


# torch.load accepts a "pickle module"; this one can only build tensors and plain values
SAFE_PICKLE = types.SimpleNamespace(__name__="splitflow_safe_pickle", Unpickler=_SafeUnpickler,
                                    load=_safe_load)


def load_diffsynth_file(path: str | os.PathLike) -> Any:
    """Unpickle one DiffSynth cache file with the allow-list; tensors land on the CPU."""
    try:
        return torch.load(path, map_location="cpu", pickle_module=SAFE_PICKLE, weights_only=False)
    except Exception as e:
        raise CacheFormatError(f"DiffSynth cache file {os.fspath(path)}: {type(e).__name__}: {e}") from e


DEFAULT_RENAME = {"input_latents": "latents", "prompt_emb": "prompt_embeds",
                  "prompt_emb_mask": "prompt_embeds_mask"}
DEFAULT_DROP = ("noise", "latents")  # DiffSynth's "latents" is the noise: dead weight in stage 2


def _tensor_fields(data: Any, where: str) -> dict[str, Any]:
    dicts = data[:2] if isinstance(data, (tuple, list)) else (data,)
    if not dicts or not all(isinstance(d, dict) for d in dicts):
        raise CacheFormatError(f"{where}: expected a (shared, positive, negative) tuple of dicts")
    merged: dict[str, Any] = {}
    for d in dicts:  # the negative inputs are the positive ones again at cfg_scale 1: skipped
        merged.update(d)
    return merged


def _tensor_list(value: Any) -> bool:
    """A non-empty list of tensors: what some units cache (Z-Image's per-prompt embeddings, edit latents)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def tensor_names(data: Any, where: str = "DiffSynth cache file") -> set[str]:
    """Names of the tensors (or lists of tensors) in the shared and positive inputs of one cached sample."""
    return {k for k, v in _tensor_fields(data, where).items() if isinstance(v, torch.Tensor) or _tensor_list(v)}


def _squeezed(t: torch.Tensor, squeeze_batch: bool) -> torch.Tensor:
    return (t[0] if squeeze_batch and t.dim() > 0 and t.shape[0] == 1 else t).contiguous()


def _listed(name: str, value: list, target: str, where: str) -> dict[str, torch.Tensor]:
    """A list of tensors as entry fields.  ``<target>`` holding ``{i}``: one batch-of-one tensor per item
    (the edit pipelines' ``edit_latents`` -> ``ref_latents_0`` ...).  Otherwise the list is DiffSynth's batch
    of one sample as a list (Z-Image's ``prompt_embeds``): its one item, which has no batch dim."""
    if "{i}" in target:
        return {target.format(i=i): _squeezed(t, True) for i, t in enumerate(value)}
    if len(value) != 1:
        raise CacheFormatError(f"{where}: {name!r} holds {len(value)} tensors where one sample's one is expected "
                               "(a data_process batch of several samples?)")
    return {target: value[0].contiguous()}


def diffsynth_entry(data: Any, where: str, rename: dict[str, str] | None = None,
                    drop: tuple[str, ...] = DEFAULT_DROP, squeeze_batch: bool = True,
                    only_renamed: bool = False, masks: Mapping[str, str] | None = None) -> Entry:
    """Map ``(inputs_shared, inputs_posi, inputs_nega)`` to a splitflow entry.

    Tensors of the shared and positive inputs become fields (renamed to splitflow's names, the
    leading batch dim of 1 removed); with ``only_renamed`` just the renamed ones, each required but
    those renamed to ``<name>_{i}`` (one field per item of a list, absent from rows without it).
    Plain values go to ``meta``.  Latents (target and references) always get the frame axis splitflow
    caches (``(C, F, h, w)``): DiffSynth's image pipelines cache ``(1, C, h, w)``.  ``masks`` (a padded
    field -> its mask): a mask the file lacks is all ones over the field's tokens, as DiffSynth keeps a
    prompt's own tokens only (one sample a file: nothing padded; Qwen-Image-2.1 stores None then).
    """
    rename = DEFAULT_RENAME if rename is None else rename
    fields = _tensor_fields(data, where)
    missing = sorted(k for k, target in rename.items() if only_renamed and "{i}" not in target
                     and not (isinstance(fields.get(k), torch.Tensor) or _tensor_list(fields.get(k))))
    if missing:
        raise CacheFormatError(f"{where}: no tensor {missing[0]!r} (expected {', '.join(rename)}); "
                               "is it a cache of another model family?")
    entry: Entry = {}
    meta: dict[str, Any] = {"source": where, "dropped": []}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and "{i}" in rename.get(name, ""):  # one item: Qwen-Image-Edit v1
            entry.update(_listed(name, [value], rename[name], where))
        elif isinstance(value, torch.Tensor) and name not in drop and (name in rename or not only_renamed):
            entry[rename.get(name, name)] = _squeezed(value, squeeze_batch)
        elif _tensor_list(value) and name in rename:
            entry.update(_listed(name, value, rename[name], where))
        elif value is None or isinstance(value, (bool, int, float, str)):
            meta[name] = value
        elif name not in drop:
            meta["dropped"].append(name)  # PIL images, devices, tensors no stage-2 forward reads ...
    if not any(isinstance(v, torch.Tensor) for v in entry.values()):
        raise CacheFormatError(f"{where}: holds no tensors")
    for name, t in list(entry.items()):
        if (name == "latents" or name.startswith("ref_latents_")) and t.dim() == 3:
            entry[name] = t[:, None]
    for name, mask in (masks or {}).items():
        if isinstance(entry.get(name), torch.Tensor) and mask not in entry:
            entry[mask] = torch.ones(entry[name].shape[0], dtype=torch.long)
    entry["meta"] = meta
    return entry


def diffsynth_files(src: str | os.PathLike) -> list[Path]:
    """``<rank>/<i>.pth`` files in a stable order (rank, then index), not listing order."""
    root = Path(src)
    if not root.is_dir():
        raise CacheFormatError(f"DiffSynth cache folder {root} does not exist (give the --output_path of "
                               "its data_process task)")
    files = [p for d in root.iterdir() if d.is_dir() and d.name.isdigit() for p in d.glob("*.pth")]
    if not files:
        raise CacheFormatError(f"{root}: no <rank>/<i>.pth files (not a DiffSynth split-training cache)")
    special = [p for p in files if not p.is_file()]  # a FIFO would block its reader forever
    if special:
        raise CacheFormatError(f"{special[0]} is not a regular file ({len(special)} such under {root}): a DiffSynth "
                               "cache holds only the .pth files its data_process task wrote; remove it")

    def order(p: Path):
        return (int(p.parent.name), int(p.stem) if p.stem.isdigit() else 1 << 62, p.stem)

    return sorted(files, key=order)


def import_diffsynth_cache(src: str | os.PathLike, dest_url: str, *, backend: str | None = None,
                           fingerprint: str = "diffsynth-import", rename: dict[str, str] | None = None,
                           drop: tuple[str, ...] = DEFAULT_DROP, commit_every: int = 256,
                           storage_options: dict | None = None, only_renamed: bool = False,
                           family: str | None = None, masks: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Copy every ``<rank>/<i>.pth`` under ``src`` into the cache at ``dest_url``.

    Keys hash each file's bytes, so re-running skips what was imported; the dataset keys are
    all imported entries in (rank, index) order.  A bad file stops the import with an error
    naming it; everything committed before stays intact.  ``rename``/``only_renamed``/``masks``: see
    :func:`diffsynth_entry`; ``family`` is recorded in the cache (checked against training
    configs).  Returns a summary dict.
    """
    files = diffsynth_files(src)
    store = open_cache(dest_url, "a", backend=backend, fingerprint=fingerprint, family=family,
                       writer="diffsynth-import", storage_options=storage_options)
    keys, imported = [], 0
    for path in files:
        key = entry_key({"diffsynth_file": f"{path.parent.name}/{path.name}"}, [path],
                        {"rename": rename, "only_renamed": only_renamed, **({"masks": masks} if masks else {})})
        keys.append(key)
        if store.has(key):
            continue
        where = f"{path.parent.name}/{path.name}"
        store.put(key, diffsynth_entry(load_diffsynth_file(path), where, rename, drop, only_renamed=only_renamed,
                                       masks=masks))
        imported += 1
        if imported % commit_every == 0:
            store.commit()
    store.commit()
    store.set_dataset_keys(keys)
    return {"source": os.fspath(src), "cache": store.url, "files": len(files), "imported": imported,
            "already_present": len(files) - imported, "keys": keys}
