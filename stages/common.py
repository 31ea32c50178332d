"""Small helpers both stages share: device choice, model loading and identity from a config."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from cache_store.digests import file_digest
from diffsynth_core.models import FamilySpec, get_family

from .config import RunConfig
from diffsynth_core.errors import InputError


def resolve_device(name: str, key: str = "device") -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU; ``key`` names the setting."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"{key} = {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{key} = {name!r}, but this machine has no CUDA device: set {key} = \"auto\" or \"cpu\"")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InputError(f"{key} = {name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


_joined_group = False  # init_distributed joined a process group in this process (destroyed or not)


def init_distributed(device: torch.device) -> torch.device:
    """Join the process group a launcher (torchrun) describes in the environment, if any.

    Returns the device this rank computes on: ``cuda:LOCAL_RANK`` for CUDA runs (NCCL),
    the given device otherwise (gloo).  A single process is left untouched.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    global _joined_group
    _joined_group = True
    return device


def joined_process_group() -> bool:
    """Whether this process joined a launcher's process group (``init_distributed``)."""
    return _joined_group


@contextmanager
def leaving_process_group() -> Iterator[None]:
    """Destroys, at the end of the block, a process group that :func:`init_distributed` joined in it.

    A gloo group left for the interpreter's exit can abort a run that finished well (its threads
    outlive Python: "terminate called without an active exception", SIGABRT, after the exports).
    After a failure only a gloo group is destroyed: NCCL's shutdown may wait on a collective that
    the failed rank's peers never finish, and the process is ending anyway.
    """
    joined_before = dist.is_initialized()
    try:
        yield
    except BaseException:
        if not joined_before and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        raise
    if not joined_before and dist.is_initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def model_dtype(cfg: RunConfig) -> torch.dtype:
    return getattr(torch, cfg.model.dtype)


def _expand(paths: list[str], key: str) -> list[Path]:
    """Files named by ``paths`` (folders expanded), sorted, each once; a missing one names ``key``."""
    files: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.update(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.add(path)
        else:
            raise InputError(f"{key}: {path} does not exist")
    return sorted(files)


def component_files(cfg: RunConfig, spec: FamilySpec, name: str) -> list[Path]:
    """The files component ``name`` is loaded from, in a stable order (what identifies it).

    ``model.sources[name]`` when given (files as released, see ``models/released.py``), else the
    subfolder ``name`` of ``model.path`` (diffusers layout).  Loading reads exactly these files,
    so identity and loading always agree.
    """
    if name in (cfg.model.sources or {}):
        return _expand(cfg.model.sources[name], f"model.sources.{name}")
    root = Path(cfg.model.path)
    if not cfg.model.path:
        raise InputError("model.path is empty: set it to a diffusers-layout model folder, or give "
                         f"model.sources.{name}")
    if not root.is_dir():
        raise InputError(f"model.path {root} is not a directory (expected a diffusers-layout model folder); "
                         f"or give model.sources.{name}")
    folder = root / name
    if not folder.is_dir():
        raise InputError(f"model folder {root} has no {name}/ component, which family {spec.name} needs")
    return sorted(p for p in folder.rglob("*") if p.is_file())


def load_components(cfg: RunConfig, spec: FamilySpec, names: tuple[str, ...], device: str = "cpu") -> dict:
    """Components ``names``: from ``model.sources`` (released files) or the diffusers folder ``model.path``."""
    from diffsynth_core.models import released

    dtype, out = model_dtype(cfg), {}
    sources = cfg.model.sources or {}
    from_folder = tuple(n for n in names if n not in sources)
    if from_folder:
        for name in from_folder:
            component_files(cfg, spec, name)  # a missing folder is one clear line, naming model.path
        out.update(spec.load_components(Path(cfg.model.path), from_folder, dtype, device))
    for name in names:
        if name not in sources:
            continue
        out[name] = released.load_named(spec.released_formats, name, component_files(cfg, spec, name), dtype, device)
    return {name: out[name] for name in names}


def check_lora_targets(cfg: RunConfig, spec: FamilySpec, local: bool = True) -> None:
    """Every LoRA target must name a Linear of the DiT: checked on a weightless (meta) build, so a
    bad target is reported before any server starts or weight is read (all bad ones in one line).

    ``local=False``: the stage runs on work pools, whose machines hold the model; when its files are
    not on this machine the check is left to them (their load names what is missing)."""
    from diffsynth_core.models import released
    from diffsynth_core.training.lora import read_lora_file, resolve_lora_targets

    train, name = cfg.train, spec.transformer_component
    if train.lora_rank <= 0 and not train.lora_checkpoint or name in train.trainable_models or \
            cfg.model.transformer_file:
        return
    if name in (cfg.model.sources or {}):
        if not local and not all(Path(p).exists() for p in cfg.model.sources[name]):
            return
        model = released.build_on_meta(spec.released_formats, name, component_files(cfg, spec, name))
    elif (Path(cfg.model.path) / "model_index.json").is_file():
        component_files(cfg, spec, name)  # the folder must exist (one clear line otherwise)
        model = released.build_folder_component_on_meta(Path(cfg.model.path), name)
    else:
        return  # not a diffusers folder: loading reports it
    if train.lora_checkpoint:  # the file continued must fit this DiT (its own names, or DiffSynth's)
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        read_lora_file(train.lora_checkpoint, linears, spec.native_module_name)
        return
    resolve_lora_targets(model, train.lora_target_modules or list(spec.lora_target_modules))


def _file_label(path: Path, folder: Path) -> str:
    """A file's name within its component (relative path in a folder, else the file name)."""
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return path.name


def component_digests(cfg: RunConfig, spec: FamilySpec, name: str) -> dict[str, str]:
    """sha256 of every file component ``name`` loads from, by name within the component."""
    paths = component_files(cfg, spec, name)
    folder = Path(cfg.model.path) / name
    if name in (cfg.model.sources or {}):  # files as released: named within their common folder
        folder = Path(os.path.commonpath([str(p.parent) for p in paths]))
    return {_file_label(path, folder): file_digest(path) for path in paths}


def encoder_identity(cfg: RunConfig, spec: FamilySpec) -> dict:
    """What identifies the encoders: the family, and the content of every file they load from.

    Digests are remembered per file (path, size, mtime, inode) across runs, so only the first
    run on a machine reads the weights in full; a same-size edit still changes the identity.
    """
    components = {name: component_digests(cfg, spec, name) for name in spec.encoder_components}
    return {"family": spec.name, "components": components}


def family_of(cfg: RunConfig) -> FamilySpec:
    """The family spec a config trains, its variant applied: ``model.variant``, else the one the
    model files tell (``FamilySpec.variant_of``).  A family with variants whose files cannot tell
    them apart is refused, naming the choices, rather than guessed."""
    spec = get_family(cfg.model.family)
    if not spec.variants:
        return get_family(cfg.model.family, cfg.model.variant)
    variant = cfg.model.variant
    # The folder first, then a single DiT file, then released files (DiffSynth's layout).
    sources = (cfg.model.sources or {}).get(spec.transformer_component, [])
    places = [where for where in [cfg.model.path, cfg.model.transformer_file, *sources] if where]
    # Files need not exist yet to tell by name (a release's folder); None: no place to ask.
    for where in [Path(where) for where in places] or [None]:
        if variant is None and spec.variant_of is not None:
            variant = spec.variant_of(where)
    if variant is None and spec.encoders_variant is not None and cfg.model.sources:
        variant = spec.encoders_variant(cfg.model.sources)  # e.g. stage 1 of a split run: encoders only
    where = places[0] if places else None
    if variant is None:
        if not cfg.model.path and not cfg.model.sources:  # no model at all: that is the line to give
            component_files(cfg, spec, spec.transformer_component)
        choices = ", ".join(sorted(spec.variants))
        raise InputError(f"model.variant: the files of {where or 'model.path'} do not tell which "
                         f"{spec.name} variant they are; set model.variant to one of: {choices}")
    return get_family(cfg.model.family, variant)
