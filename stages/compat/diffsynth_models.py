"""DiffSynth-Studio's model references -> ``model.family`` and ``model.sources``.

DiffSynth names models two ways (diffsynth/diffusion/training_module.py ``parse_model_configs``,
diffsynth/core/loader/config.py ``ModelConfig``):

* ``--model_id_with_origin_paths "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,..."``:
  each entry ``<model_id>:<pattern>`` is globbed under ``<base>/<model_id>/`` where ``<base>`` is
  ``$DIFFSYNTH_MODEL_BASE_PATH`` or ``./models`` (an empty pattern or ``./`` means the whole folder,
  a trailing ``/`` its files); an entry that is an existing path is that path;
* ``--model_paths '["a.safetensors", ["shard1", "shard2"]]'``: JSON, each item a file, folder or list.

splitflow never downloads: a pattern that matches nothing is an error naming the folder.  Each
entry's files are recognised by their keys (``models/released.py``), which gives the family and
the component; tokenizers come from DiffSynth's default folders or ``--tokenizer*_path``.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from diffsynth_core.models import get_family, known_families
from diffsynth_core.models.released import recognise, weight_and_config_files

from ..config import ConfigError

# Where each family's train.py looks for its tokenizers unless a flag names them
# (examples/<family>/model_training/train.py: ModelConfig(model_id=..., origin_file_pattern=...)).
DEFAULT_TOKENIZERS = {
    "qwen_image": {"tokenizer": ("tokenizer_path", "Qwen/Qwen-Image:tokenizer/")},
    "flux": {"tokenizer": ("tokenizer_1_path", "black-forest-labs/FLUX.1-dev:tokenizer/"),
             "tokenizer_2": ("tokenizer_2_path", "black-forest-labs/FLUX.1-dev:tokenizer_2/")},
    "wan": {"tokenizer": ("tokenizer_path", "Wan-AI/Wan2.1-T2V-1.3B:google/umt5-xxl/")},
    "z_image": {"tokenizer": ("tokenizer_path", "Tongyi-MAI/Z-Image-Turbo:tokenizer/")},
    # examples/qwen_image_21/model_training/train.py: the processor (tokenizer inside) unless --processor_path
    "qwen_image21": {"processor": ("processor_path", "Qwen/Qwen-Image-2.1:processor/")},
    "flux2": {"tokenizer": ("tokenizer_path", "black-forest-labs/FLUX.2-dev:tokenizer/")},
}


def model_base(flags: dict[str, str]) -> Path:
    """Where DiffSynth keeps downloads: --model_base_path, else $DIFFSYNTH_MODEL_BASE_PATH, else ./models."""
    return Path(flags.get("model_base_path") or os.environ.get("DIFFSYNTH_MODEL_BASE_PATH") or "./models")


def _download_hint(model_id: str, pattern: str, base: Path) -> str:
    return (f"splitflow does not download: fetch it first, e.g. `modelscope download --model {model_id} "
            f"--include '{pattern}' --local_dir {base / model_id}`, or set DIFFSYNTH_MODEL_BASE_PATH")


def resolve_entry(entry: str, base: Path, what: str = "--model_id_with_origin_paths") -> list[Path]:
    """The files of one ``model_id:pattern`` entry (or path), as DiffSynth's ModelConfig finds them."""
    if os.path.exists(entry):
        return [Path(entry)]
    if ":" not in entry:
        raise ConfigError(f"{what} entry {entry!r} is neither an existing path nor <model_id>:<file pattern>")
    model_id, pattern = entry.rsplit(":", 1)
    glob_pattern = "*" if pattern in ("", "./") else pattern + "*" if pattern.endswith("/") else pattern
    files = sorted(Path(p) for p in glob.glob(str(base / model_id / glob_pattern)))
    if not files:
        raise ConfigError(f"{what} {entry!r} matches no file under {base / model_id}; "
                          + _download_hint(model_id, glob_pattern, base))
    return files


def _expand(paths: list[Path]) -> list[Path]:
    out = []
    for path in paths:
        out.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    return out


def model_groups(flags: dict[str, str]) -> list[tuple[str, list[Path]]]:
    """``(entry, files)`` for every model entry of --model_paths and --model_id_with_origin_paths."""
    groups = []
    if flags.get("model_paths"):
        try:
            items = json.loads(flags["model_paths"])
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--model_paths must be a JSON list of paths ({exc})") from None
        for item in items if isinstance(items, list) else [items]:
            paths = [Path(p) for p in (item if isinstance(item, list) else [item])]
            missing = [str(p) for p in paths if not p.exists()]
            if missing:
                raise ConfigError(f"--model_paths: {', '.join(missing)} does not exist")
            groups.append((json.dumps(item), _expand(paths)))
    base = model_base(flags)
    for entry in filter(None, (flags.get("model_id_with_origin_paths") or "").split(",")):
        groups.append((entry, _expand(resolve_entry(entry.strip(), base))))
    return groups


def _family_of(found: list[tuple[str, list]], wanted: str | None) -> str:
    """The one family every entry can belong to (``wanted`` when the user named it)."""
    families = set(known_families()) if wanted is None else {wanted}
    for entry, candidates in found:
        families &= {family for family, _ in candidates}
    if len(families) == 1:
        return families.pop()
    named = "; ".join(f"{entry} -> {sorted({f for f, _ in c})}" for entry, c in found)
    if not families:
        raise ConfigError(f"the model files do not belong to one family{'' if wanted is None else ' ' + wanted} "
                          f"({named})")
    raise ConfigError(f"the model files fit several families {sorted(families)}: add --set model.family=NAME")


def _beside_config(files: list[Path], fmt) -> list[Path]:
    """A ``config.json`` in the weights' folder joins them when the format reads it (diffusers/transformers names)."""
    weights, config = weight_and_config_files(files)
    folders = {p.parent for p in weights}
    if config is None and fmt.convert is None and len(folders) == 1:
        candidate = folders.pop() / "config.json"
        if candidate.is_file():
            return [*files, candidate]
    return files


def resolve_models(flags: dict[str, str], family: str | None) -> tuple[str, dict[str, list[str]]]:
    """``(family, sources)`` from the model flags; every entry recognised by its keys."""
    found = []
    for entry, files in model_groups(flags):
        candidates = recognise({name: get_family(name).released_formats for name in known_families()}, files)
        if not candidates:
            raise ConfigError(f"model entry {entry}: {files[0] if files else 'no files'} is no component splitflow "
                              "recognises (Qwen-Image, Qwen-Image-2.1, FLUX.1, FLUX.2, Wan2.1 or Z-Image weights as "
                              "released)")
        found.append((entry, candidates, files))
    family = _family_of([(entry, c) for entry, c, _ in found], family)
    sources: dict[str, list[str]] = {}
    for entry, candidates, files in found:
        fmt = next(fmt for name, fmt in candidates if name == family)
        if fmt.component in sources:
            raise ConfigError(f"model entry {entry} is a second {fmt.component}; give each component once")
        # absolute, not resolved: a linked download keeps the release's folder name, which tells variants
        sources[fmt.component] = [os.path.abspath(p) for p in _beside_config(files, fmt)]
    return family, sources


# Components a variant's encoders add, and where DiffSynth's train.py finds them unless a flag names
# them (examples/qwen_image/model_training/train.py: processor_config, "Qwen/Qwen-Image-Edit:processor/"
# for every edit model).
DEFAULT_VARIANT_FILES = {
    "processor": ("processor_path", "Qwen/Qwen-Image-Edit:processor/"),
}


def _variant_of_sources(spec, sources: dict[str, list[str]]) -> str | None:
    """The variant the transformer's files tell (its release's folder name in DiffSynth's layout)."""
    if spec.variant_of is None:
        return None
    for path in sources.get(spec.transformer_component, []):
        variant = spec.variant_of(Path(path))
        if variant is not None:
            return variant
    return None


def add_tokenizers(family: str, sources: dict[str, list[str]], flags: dict[str, str]) -> None:
    """Tokenizer folders where the encoders are given: DiffSynth's defaults unless a flag names them
    (and the processor of an edit variant: the transformer's files tell which)."""
    spec = get_family(family)
    if not any(name in sources for name in spec.encoder_components):
        return
    base = model_base(flags)
    variant = _variant_of_sources(spec, sources)
    extra = {} if variant is None else {
        name: DEFAULT_VARIANT_FILES[name] for name in get_family(family, variant).encoder_components
        if name in DEFAULT_VARIANT_FILES and name not in spec.encoder_components}
    for component, (flag, default) in {**DEFAULT_TOKENIZERS.get(family, {}), **extra}.items():
        if component in sources:
            continue
        if flags.get(flag) and not os.path.exists(flags[flag]) and ":" not in flags[flag]:
            raise ConfigError(f"--{flag} {flags[flag]} is neither a folder nor <model_id>:<folder pattern>")
        if flags.get(flag) and os.path.exists(flags[flag]):
            path = Path(flags[flag])
            if not path.is_dir():
                raise ConfigError(f"--{flag} {path} is not a folder")
            sources[component] = [str(path.resolve())]
        else:  # DiffSynth's default, or the flag's <model_id>:<pattern> (parse_path_or_model_id)
            entry, what = (flags[flag], f"--{flag}") if flags.get(flag) else (
                default, f"the {component} (DiffSynth's default; or give --{flag})")
            found = resolve_entry(entry, base, what)
            sources[component] = [os.path.commonpath([str(p.resolve().parent) for p in found])]


def cache_in_folder(folder: Path) -> tuple[str, str] | None:
    """``(url, backend)`` of the splitflow cache that ``splitflow preprocess`` wrote under ``folder``."""
    for backend in ("zarr", "pth"):
        if (folder / f"cache.{backend}").exists():
            return str((folder / f"cache.{backend}").resolve()), backend
    return None


def is_diffsynth_cache(folder: Path) -> bool:
    """DiffSynth's ``sft:data_process`` output: ``<rank>/<i>.pth`` files."""
    return folder.is_dir() and any(d.is_dir() and d.name.isdigit() and any(d.glob("*.pth")) for d in folder.iterdir())
