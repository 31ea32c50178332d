"""What a run needs that can be checked from disk, checked before Prefect starts, and a failed first run's
leftovers taken away.

``check_inputs`` answers in a second or two what would otherwise fail after a server start and a flow run
(the dataset, its metadata file, the model folder, the cache training reads, the output path), each as one
line naming the key to fix.  ``first_run_cleanup`` removes what a failed run created and holds no work: an
output folder with only Prefect's and splitflow's bookkeeping in it, a cache folder with no entry.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from diffsynth_core.errors import EnvironmentFailure, InputError

from .config import RunConfig

DEMO_DIR = "splitflow-demo"  # where `make demo` / `splitflow demo` write (examples/tiny_demo.toml reads it)
# What a run writes into its output folder before any work: nothing of it is worth keeping on its own.
BOOKKEEPING = {".prefect", ".splitflow", ".splitflow.lock", "config.toml", "preprocess.toml", "train.toml"}
NEVER_DOWNLOADS = ("splitflow never downloads models: put the model's files there first (a diffusers folder, e.g. "
                   "`huggingface-cli download <repo id> --local-dir {path}`) or point model.path at them; files as "
                   "released (DiffSynth-Studio's downloads): docs/diffsynth.md")


def check_inputs(cfg: RunConfig, stages: tuple[str, ...]) -> int | None:
    """Raise one ``InputError`` (exit 2) or ``EnvironmentFailure`` (exit 3) for the first input of ``stages``
    that cannot work: read from disk only, nothing written.  Returns the dataset's rows (None: not read)."""
    from diffsynth_core.models import check_model_folder

    from .common import check_lora_targets, component_files, family_of

    _check_model_folder(cfg)
    spec = family_of(cfg)
    if cfg.model.path:
        check_model_folder(spec, cfg.model.path)  # a folder of another family, named before any weight loads
    components = (spec.encoder_components if "preprocess" in stages else ()) + (
        (spec.transformer_component,) if "train" in stages else ())
    for name in dict.fromkeys(components):
        _check_model(cfg, lambda n=name: component_files(cfg, spec, n))
    targets_given = cfg.train.lora_target_modules or cfg.train.lora_checkpoint
    if "train" in stages and targets_given:  # what the user typed first; a family's defaults are checked last
        check_lora_targets(cfg, spec)  # on a weightless build: every bad target in one line
    rows = None
    if "preprocess" in stages or cfg.dataset.metadata_path or cfg.dataset.sources:
        rows = _check_metadata(cfg, spec)
        _check_dataset_folder(cfg)
    if "preprocess" not in stages:
        _check_cache(cfg, spec)
    _check_writable(cfg.output_dir, "output.path")
    if "preprocess" in stages and "://" not in cfg.cache_url:
        _check_writable(Path(cfg.cache_url), "cache.url")
    if "train" in stages and not targets_given:  # last: the DiT on meta imports diffusers (seconds)
        check_lora_targets(cfg, spec)
    return rows


def length_note(cfg: RunConfig, rows: int | None) -> str | None:
    """Which of ``train.max_steps`` and ``train.num_epochs`` decides the run's length, when max_steps makes
    another number of epochs than num_epochs says (``rows``: the dataset's, before repeats; buckets of
    shapes can add a batch or two to an epoch, hence "about")."""
    train = cfg.train
    if not train.max_steps or not rows:
        return None
    batches = -(-rows * cfg.dataset.repeat // train.batch_size)
    epochs = train.max_steps * train.gradient_accumulation_steps / batches
    if abs(epochs - train.num_epochs) < 0.05:
        return None
    return (f"train.max_steps = {train.max_steps} decides the run's length: about {epochs:.3g} epochs of "
            f"{batches} batches; train.num_epochs = {train.num_epochs} is not used while max_steps is set")


def input_rows(cfg: RunConfig) -> int | None:
    """The dataset's rows (before repeats) of a config whose inputs check out; None without a dataset."""
    return check_inputs(cfg, ("preprocess", "train")) if (cfg.dataset.metadata_path or cfg.dataset.sources) else None


def input_problem(cfg: RunConfig, stages: tuple[str, ...] = ("preprocess", "train")) -> str | None:
    """``check_inputs``'s one line, or None: for verbs that report rather than run (``status``)."""
    try:
        check_inputs(cfg, stages)
    except (InputError, EnvironmentFailure) as err:
        return str(err)
    return None


def _demo_hint(path: str | Path) -> str:
    """A path inside the demo's folder that is missing: the demo has not run here."""
    if DEMO_DIR in Path(path).parts:
        return (f"; {DEMO_DIR}/ is what `make demo` (or `splitflow demo`) writes: run it first, from the folder "
                f"this config's relative paths start in")
    return ""


def _check_dataset_folder(cfg: RunConfig) -> None:
    base = cfg.dataset.base_path
    if base and not Path(base).is_dir():
        raise InputError(f"dataset.base_path {base} is not a folder: point it at the folder the metadata's file "
                         f"names are relative to{_demo_hint(base)}")


def _model_hint(cfg: RunConfig) -> str:
    path = cfg.model.path or "model.path"
    return _demo_hint(path) or f"; {NEVER_DOWNLOADS.format(path=path)}"


def _check_model_folder(cfg: RunConfig) -> None:
    path = cfg.model.path
    if path and not Path(path).is_dir() and not cfg.model.sources:
        raise InputError(f"model.path {path} is not a folder{_model_hint(cfg)}")


def _check_model(cfg: RunConfig, files) -> None:
    try:
        files()
    except InputError as err:
        raise InputError(f"{err}{_model_hint(cfg)}") from None


def _check_metadata(cfg: RunConfig, spec) -> int:
    from .datasets import open_dataset

    metadata = cfg.dataset.metadata_path
    if metadata and not cfg.dataset.sources and not Path(metadata).exists():
        raise InputError(f"dataset.metadata_path {metadata} does not exist: point it at your metadata.csv/.json/"
                         f".jsonl (columns image, prompt), a folder of images with same-name .txt captions, or a "
                         f"musubi-tuner dataset .toml (docs/datasets.md){_demo_hint(metadata)}")
    return len(open_dataset(cfg.dataset, spec))  # parses the metadata: a bad header or row is one line naming it


def _check_cache(cfg: RunConfig, spec) -> None:
    """The cache training reads: it exists; an imported one (nothing to derive its keys from) is of this
    family and its rows fit the model (what the train stage checks again, where it runs)."""
    from cache_store.opener import check_identity

    from .keys import imported_training_keys, is_imported
    from .status import _open_existing

    store, why = _open_existing(cfg)
    if store is None:
        raise InputError(f"cache.url {cfg.cache_url} holds no cache yet ({why}): run `splitflow preprocess CONFIG` "
                         f"(or `splitflow run CONFIG`) first, or point cache.url at an existing cache")
    if is_imported(store):
        check_identity(store.url, (store.fingerprint, store.family), None, cfg.model.family)
        imported_training_keys(cfg, store, spec)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(path: Path, key: str) -> None:
    if path.exists() and not path.is_dir():
        raise InputError(f"{key} {path} is a file, not a folder: point {key} at a folder (it is created if missing)")
    existing = _nearest_existing(path)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise EnvironmentFailure(f"{key} {path}: {existing} is read-only for this user; choose another {key} "
                                 f"or fix its permissions")


@contextlib.contextmanager
def first_run_cleanup(cfg: RunConfig):
    """On a failure, remove the output folder and the local cache folder this run created while they hold no
    work (no checkpoint, metric or export; no cache entry): a failed first run leaves nothing behind."""
    output = Path(cfg.output_dir)
    cache = Path(cfg.cache_url) if "://" not in cfg.cache_url else None
    created = [p for p in (output, cache) if p is not None and not p.exists()]
    try:
        yield
    except BaseException:
        for path in created:
            if path.is_dir() and _holds_no_work(path, is_cache=path == cache):
                shutil.rmtree(path, ignore_errors=True)
        raise


def _holds_no_work(path: Path, is_cache: bool) -> bool:
    if not is_cache:
        return {entry.name for entry in path.iterdir()} <= BOOKKEEPING
    from cache_store import CacheFormatError, open_cache

    try:
        store = open_cache(str(path), mode="r")
    except (FileNotFoundError, CacheFormatError):
        return False  # not readable as a cache: keep it, whatever it holds
    return not store.keys() and not store.skipped()
