"""Loading a model folder in the diffusers layout, component by component.

The folder's ``model_index.json`` names the library and class of every component, so real
model folders and the tiny ones from ``save_tiny_model`` go through the same code.  Weights
are loaded with ``dtype=`` (never ``.to(dtype)`` afterwards): diffusers/transformers then
keep each model's ``_keep_in_fp32_modules`` in fp32 and read safetensors lazily (mmap), so
there is no 2x RAM peak.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from .base import Components

# Libraries a model_index.json may name; anything else is refused rather than imported.
_ALLOWED_LIBRARIES = ("diffusers", "transformers")


def read_model_index(path: Path) -> dict[str, tuple[str, str]]:
    """``{component: (library, class name)}`` from ``path/model_index.json``."""
    index_file = Path(path) / "model_index.json"
    if not index_file.is_file():
        raise FileNotFoundError(f"{index_file} not found: {path} is not a model folder in the diffusers layout")
    raw = json.loads(index_file.read_text())
    return {
        name: (entry[0], entry[1])
        for name, entry in raw.items()
        if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and entry[0] is not None
    }


def _component_class(name: str, library: str, class_name: str, folder: Path) -> type:
    if library not in _ALLOWED_LIBRARIES:
        raise ValueError(f"{folder}/model_index.json: component {name!r} comes from {library!r}; "
                         f"only {', '.join(_ALLOWED_LIBRARIES)} are supported")
    module = importlib.import_module(library)
    if not hasattr(module, class_name):
        raise ValueError(f"{folder}/model_index.json: component {name!r} names unknown class {library}.{class_name}")
    return getattr(module, class_name)


def _is_weighted(cls: type) -> bool:
    """True for torch modules (they take ``dtype=``); False for tokenizers and schedulers."""
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def load_component(path: Path, name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> Any:
    """Load one component of the model folder ``path`` (``path/<name>/``) in ``dtype`` onto ``device``."""
    path = Path(path)
    index = read_model_index(path)
    if name not in index:
        raise KeyError(f"component {name!r} is not in {path}/model_index.json; it has: {', '.join(sorted(index))}")
    cls = _component_class(name, *index[name], folder=path)
    folder = path / name
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is missing (named in {path}/model_index.json)")
    if not _is_weighted(cls):
        return cls.from_pretrained(folder)
    model = cls.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=True)  # returns it in eval mode
    if torch.device(device).type != "cpu":
        model = model.to(device)  # no dtype: keeps the fp32 modules fp32
    return model


def load_components(path: Path, names: tuple[str, ...], dtype: torch.dtype, device: str | torch.device,
                    *, allowed: tuple[str, ...]) -> Components:
    """Load ``names`` (each must be in ``allowed``, the family's components) from the folder ``path``."""
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"unknown component(s) {unknown}; this family has: {', '.join(allowed)}")
    return {name: load_component(Path(path), name, dtype, device) for name in names}


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The diffusers model inside DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrappers."""
    for attr in ("module", "_orig_mod"):
        inner = getattr(module, attr, None)
        if isinstance(inner, torch.nn.Module):
            return unwrap(inner)
    return module


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The compute dtype of a (possibly LoRA-wrapped) DiT: its output projection's base weight dtype.

    ``ModelMixin.dtype`` may report fp32 once fp32 LoRA parameters are injected into a bf16 model.
    """
    proj = unwrap(module).proj_out
    return getattr(proj, "base_layer", proj).weight.dtype
