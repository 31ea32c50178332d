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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, classify
from .base import Components

# Libraries a model_index.json may name; anything else is refused rather than imported.
_ALLOWED_LIBRARIES = ("diffusers", "transformers")

# Model construction is not thread-safe: accelerate's init_empty_weights and diffusers'
# no_init_weights monkeypatch nn.Module.register_parameter / torch.nn.init process-wide and
# restore what they saved on exit.  Two loads interleaving in threads (preprocess parts run
# concurrently) can restore each other's patch and leave every later model on the meta device.
# Every model build in this package holds this lock.
MODEL_INIT_LOCK = threading.RLock()


def read_model_index_file(path: Path) -> dict[str, Any]:
    """The raw ``path/model_index.json``; a missing or unreadable one names the folder (exit code 2)."""
    index_file = Path(path) / "model_index.json"
    if not index_file.is_file():
        raise InputError(f"{index_file} not found: model.path {path} is not a model folder in the diffusers layout")
    try:
        raw = json.loads(index_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{index_file} is not valid JSON ({err}): the model folder is damaged; copy it again") from None
    if not isinstance(raw, dict):
        raise InputError(f"{index_file} must hold a JSON object: the model folder is damaged; copy it again")
    return raw


def read_model_index(path: Path) -> dict[str, tuple[str, str]]:
    """``{component: (library, class name)}`` from ``path/model_index.json``."""
    raw = read_model_index_file(path)
    return {
        name: (entry[0], entry[1])
        for name, entry in raw.items()
        if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and entry[0] is not None
    }


def _component_class(name: str, library: str, class_name: str, folder: Path) -> type:
    if library not in _ALLOWED_LIBRARIES:
        raise InputError(f"{folder}/model_index.json: component {name!r} comes from {library!r}; "
                         f"only {', '.join(_ALLOWED_LIBRARIES)} are supported")
    module = importlib.import_module(library)
    if not hasattr(module, class_name):
        raise InputError(f"{folder}/model_index.json: component {name!r} names unknown class {library}.{class_name} "
                         f"(a newer {library} may know it)")
    return getattr(module, class_name)


def _is_weighted(cls: type) -> bool:
    """True for torch modules (they take ``dtype=``); False for tokenizers and schedulers."""
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def load_component(path: Path, name: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> Any:
    """Load one component of the model folder ``path`` (``path/<name>/``) in ``dtype`` onto ``device``."""
    path = Path(path)
    index = read_model_index(path)
    if name not in index:
        raise InputError(f"component {name!r} is not in {path}/model_index.json; it has: {', '.join(sorted(index))}")
    cls = _component_class(name, *index[name], folder=path)
    folder = path / name
    if not folder.is_dir():
        raise InputError(f"{folder} is missing (named in {path}/model_index.json): the model folder is incomplete")
    with MODEL_INIT_LOCK, named_load_errors(folder):
        if not _is_weighted(cls):
            return cls.from_pretrained(folder)
        model = cls.from_pretrained(folder, dtype=dtype, low_cpu_mem_usage=True)  # returns it in eval mode
    check_materialised(model, folder)
    if torch.device(device).type != "cpu":
        model = model.to(device)  # no dtype: keeps the fp32 modules fp32
    return model


def check_materialised(model: torch.nn.Module, source: Path) -> None:
    """Raise if any weight is still on the meta device (a weight missing from the files)."""
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise InputError(f"{source}: {len(meta)} weight(s) are missing from the weight files (e.g. {meta[:3]}): "
                         f"the download is incomplete or the files belong to another model; copy them again")


@contextmanager
def named_load_errors(folder: Path):
    """A library's failure to read a component's files becomes one line naming the folder and file.

    diffusers/transformers/safetensors raise OSError, ValueError, RuntimeError or SafetensorError
    (whose message names no file) for truncated, missing or foreign weight files.  A full disk or a
    permission problem stays an environment failure (``classify``).
    """
    try:
        yield
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 -- only library load errors reach here; bugs are re-raised
        if classify(err) is not None or not _is_load_error(err):
            raise
        raise InputError(f"{folder}: cannot load {_broken_weight_file(folder) or 'its weight files'} "
                         f"({type(err).__name__}: {_first_line(err)}); the files are incomplete, corrupt or "
                         f"of another model: copy or download them again") from err


def _is_load_error(err: BaseException) -> bool:
    return isinstance(err, (OSError, ValueError, RuntimeError, EOFError)) or type(err).__name__ == "SafetensorError"


def _broken_weight_file(folder: Path) -> str | None:
    """The first weight file whose safetensors header or size is wrong (a truncated copy), if any."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception:  # noqa: BLE001 -- any failure to open names this file
            return file.name
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


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
