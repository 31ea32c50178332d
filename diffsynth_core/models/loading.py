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
import threading
from pathlib import Path
from typing import Any

import torch

from .base import Components

# Libraries a model_index.json may name; anything else is refused rather than imported.
_ALLOWED_LIBRARIES = ("diffusers", "transformers")

# Model construction is not thread-safe: accelerate's init_empty_weights and diffusers'
# no_init_weights monkeypatch nn.Module.register_parameter / torch.nn.init process-wide and
# restore what they saved on exit.  Two loads interleaving in threads (preprocess parts run
# concurrently) can restore each other's patch and leave every later model on the meta device.
# Every model build in this package holds this lock.
MODEL_INIT_LOCK = threading.RLock()


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
    with MODEL_INIT_LOCK:
        if not _is_weighted(cls):
            return cls.from_pretrained(folder)
        model = cls.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=True)  # returns it in eval mode
    check_materialised(model, folder)
    if torch.device(device).type != "cpu":
        model = model.to(device)  # no dtype: keeps the fp32 modules fp32
    return model


def check_materialised(model: torch.nn.Module, source: Path) -> None:
    """Raise if any weight is still on the meta device (a missing weight, or a leaked init patch)."""
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise RuntimeError(f"{source}: {len(meta)} weight(s) were not loaded and are still on the meta device "
                           f"(e.g. {meta[:3]})")


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
