"""Reading weight files as released: safetensors and pickled ``.pth``, weights only, memory-mapped.

``.pth`` files (Wan's ``models_t5_umt5-xxl-enc-bf16.pth``, ``Wan2.1_VAE.pth``) are read with
``torch.load(weights_only=True)``: its unpickler builds tensors and plain containers and refuses
any other global, so a pickle can never run code.  Both formats are memory-mapped: tensors are
views of the file, so loading a model from them costs no second copy in RAM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from ..errors import InputError
from .single_file import strip_prefixes

StateDict = dict[str, torch.Tensor]
Shapes = dict[str, tuple[int, ...]]

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
# Single-key wrappers some trainers save around a state dict (DiffSynth's load_state_dict_from_bin unwraps the same).
_WRAPPERS = ("state_dict", "module", "model_state")


def is_weight_file(path: Path) -> bool:
    return Path(path).suffix in WEIGHT_SUFFIXES


def _load_pickled(path: Path) -> StateDict:
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):  # the legacy (non-zip) format cannot be memory-mapped
            raise
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(data, dict) and len(data) == 1 and next(iter(data)) in _WRAPPERS:
        data = next(iter(data.values()))
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise InputError(f"{path}: not a state dict of tensors (what a released weight file holds)")
    return data


def load_file(path: Path | str) -> StateDict:
    """Every tensor of one weight file, memory-mapped; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"weight file {path} not found")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file as load_safetensors

            return load_safetensors(str(path))
        return _load_pickled(path)
    except InputError:
        raise
    except Exception as exc:  # a truncated or foreign file: name it, whatever the library raised
        raise InputError(f"cannot read weight file {path} ({type(exc).__name__}: {exc}); "
                         "re-download it or point the config elsewhere") from exc


def load_files(paths: Iterable[Path]) -> StateDict:
    """The union of several files' tensors (shards of one model); a key in two files is an error."""
    state: StateDict = {}
    for path in paths:
        for key, value in load_file(path).items():
            if key in state:
                raise InputError(f"{path}: key {key!r} is also in another file of the same component")
            state[key] = value
    return state


def read_shapes(paths: Iterable[Path], strip: bool = True) -> Shapes:
    """``{key: shape}`` of the files (prefixes stripped unless told), without reading the weights."""
    shapes: Shapes = {}
    for path in paths:
        path = Path(path)
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(path), framework="pt") as handle:
                    shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
            except Exception as exc:
                raise InputError(f"cannot read weight file {path} ({type(exc).__name__}: {exc})") from exc
        else:  # memory-mapped: shapes cost no reads of the data
            shapes.update({k: tuple(v.shape) for k, v in load_file(path).items()})
    return strip_prefixes(shapes) if strip else shapes
