"""musubi-tuner datasets: its dataset TOML and its metadata JSONL keys, as splitflow datasets.

Names and defaults follow musubi-tuner's src/musubi_tuner/dataset/config_utils.py
(``BaseDatasetParams``, ``ImageDatasetParams``, ``VideoDatasetParams``, ``ConfigSanitizer``):
``[general]`` holds defaults for every ``[[datasets]]`` entry, which are image datasets
(``image_directory`` or ``image_jsonl_file``) or video datasets (``video_directory`` or
``video_jsonl_file``).  Each entry becomes one ``dataset.sources`` item:

* ``num_repeats`` -> ``repeat``; ``caption_extension`` -> ``caption_extension``;
* ``resolution = [W, H]`` (default 960x544) with ``enable_bucket = true`` -> ``max_pixels = W*H``
  (aspect kept, area-based), with ``enable_bucket = false`` (musubi's default) -> a fixed
  ``height = H``, ``width = W``;
* ``target_frames`` (``frame_extraction = "head"``): one source per frame count, each taking the
  first N frames, as musubi makes one item per count;
* ``batch_size`` -> ``train.batch_size`` (unless the config sets it; one value for all entries);
* ``control_directory`` -> the source's ``control_directory`` (same-stem control images, datasources.py
  ``ImageDirectoryDatasource``: ``name.png``, else ``name_0.png``, ``name_1.png``, ... by index); controls
  are sized as musubi sizes them (image_video_dataset.py ``ImageDataset``): to the target's size by
  default (``reference_size = "target"``), to about ``control_resolution = [W, H]``'s area
  (``reference_pixels``), or kept at their own size floored to the multiple with ``no_resize_control``
  (``reference_size = "own"``, at most ``control_resolution``'s area when both are given).

Relative paths are resolved against the working directory, as musubi opens them, and stored
absolute.  Keys with no splitflow meaning are refused, or accepted with one notice line where
they cannot change what trains (see docs/datasets.md).
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Any

from diffsynth_core.errors import InputError

log = logging.getLogger(__name__)

# musubi JSONL rows: {"image_path": ..., "caption": ...} / {"video_path": ..., "caption": ...}
MEDIA_KEY_ALIASES = {"image_path": "image", "video_path": "video"}

DEFAULTS = {"resolution": (960, 544), "enable_bucket": False, "bucket_no_upscale": False, "caption_extension": None,
            "batch_size": 1, "num_repeats": 1}  # config_utils.py BaseDatasetParams
GENERAL_KEYS = set(DEFAULTS)  # ConfigSanitizer.DATASET_ASCENDABLE_SCHEMA
IMAGE_KEYS = {"image_directory", "image_jsonl_file", "cache_directory", "control_directory", "multiple_target",
              "fp_latent_window_size", "fp_1f_clean_indices", "fp_1f_target_index", "fp_1f_no_post",
              "no_resize_control", "control_resolution"}
VIDEO_KEYS = {"video_directory", "video_jsonl_file", "control_directory", "target_frames", "frame_extraction",
              "frame_stride", "frame_sample", "max_frames", "cache_directory", "source_fps", "fp_latent_window_size"}
# Accepted, cannot change what splitflow trains: one notice line each.
NO_OP = {"cache_directory": "splitflow keeps its own cache (cache.url)",
         "bucket_no_upscale": "splitflow never upscales in area mode (enable_bucket = true)",
         "fp_latent_window_size": "FramePack only",
         "frame_stride": "only used by frame_extraction = slide", "frame_sample": "only used by uniform",
         "max_frames": "only used by frame_extraction = full"}


def with_musubi_keys(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with musubi's ``image_path``/``video_path`` also under ``image``/``video``."""
    out = []
    for row in records:
        extra = {ours: row[theirs] for theirs, ours in MEDIA_KEY_ALIASES.items() if theirs in row and ours not in row}
        out.append({**row, **extra} if extra else row)
    return out


def _fail(path: Path, where: str, message: str) -> InputError:
    return InputError(f"musubi dataset config {path}: {where}: {message}")


def _absolute(value: Any, path: Path, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(path, where, f"expected a path, got {value!r}")
    return str(Path(value).expanduser().absolute())


def _size(entry: dict[str, Any], path: Path, where: str) -> dict[str, int]:
    resolution = entry["resolution"]
    width, height = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    if not all(isinstance(v, int) and v > 0 for v in (width, height)):
        raise _fail(path, f"{where}.resolution", f"expected [width, height], got {resolution!r}")
    if entry["enable_bucket"]:
        return {"max_pixels": width * height}
    return {"height": height, "width": width}


def _check_keys(entry: dict[str, Any], allowed: set[str], path: Path, where: str) -> None:
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise _fail(path, where, f"unknown key {unknown[0]!r}")
    refused = {"multiple_target": "multiple targets (Qwen-Image-Layered)",
               "fp_1f_clean_indices": "FramePack one-frame training", "fp_1f_target_index": "FramePack one-frame",
               "fp_1f_no_post": "FramePack one-frame", "source_fps": "frame-rate conversion"}
    for key, what in refused.items():
        if entry.get(key) not in (None, False):
            raise _fail(path, f"{where}.{key}", f"{what} are not supported by splitflow")
    if entry.get("frame_extraction", "head") != "head":
        raise _fail(path, f"{where}.frame_extraction", f"{entry['frame_extraction']!r} is not supported "
                                                      "(only \"head\": the first N frames)")
    for key in sorted(set(entry) & set(NO_OP)):
        log.warning("musubi dataset config %s: %s.%s has no effect (%s)", path, where, key, NO_OP[key])


def _sources(own: dict[str, Any], general: dict[str, Any], path: Path, where: str) -> list[dict[str, Any]]:
    media = [k for k in ("image_directory", "image_jsonl_file", "video_directory", "video_jsonl_file") if k in own]
    if len(media) != 1:
        raise _fail(path, where, "give exactly one of image_directory, image_jsonl_file, video_directory, "
                                 f"video_jsonl_file (found {media or 'none'})")
    video = media[0].startswith("video")
    _check_keys(own, GENERAL_KEYS | (VIDEO_KEYS if video else IMAGE_KEYS), path, where)
    entry = {**DEFAULTS, **general, **own}  # config_utils.py generate_params_by_fallbacks
    source = {"metadata_path": _absolute(entry[media[0]], path, f"{where}.{media[0]}"),
              "repeat": entry["num_repeats"], **_size(entry, path, where)}
    if entry["caption_extension"] is not None:
        source["caption_extension"] = entry["caption_extension"]
    source.update(_control_options(entry, path, where))
    if not video:
        return [source]
    frames = entry.get("target_frames", [1])  # VideoDatasetParams.target_frames
    return [{**source, "num_frames": n} for n in dict.fromkeys(frames)]


def _control_options(entry: dict[str, Any], path: Path, where: str) -> dict[str, Any]:
    """How musubi sizes an entry's control images, as ``dataset.sources`` keys (module docstring)."""
    out: dict[str, Any] = {"reference_size": "target"}  # musubi's default: controls to the target's bucket
    if entry.get("control_directory") is not None:
        out["control_directory"] = _absolute(entry["control_directory"], path, f"{where}.control_directory")
    resolution = entry.get("control_resolution")
    if resolution is not None:
        width, height = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
        if not all(isinstance(v, int) and v > 0 for v in (width, height)):
            raise _fail(path, f"{where}.control_resolution", f"expected [width, height], got {resolution!r}")
        out.update(reference_size="family", reference_pixels=width * height)
    if entry.get("no_resize_control"):
        out["reference_size"] = "own"
    return out


def control_images(folder: Path, targets: list[Path]) -> list[list[Path]]:
    """Each target's control images in ``folder``: ``stem.*`` first, then ``stem_<digits>.*`` by number.

    musubi-tuner's rule (datasources.py ``ImageDirectoryDatasource``): longer target names match first and
    take their files, so ``cat_2.png``'s controls are not also ``cat.png``'s."""
    from .kohya import IMAGE_EXTENSIONS

    if not folder.is_dir():
        raise InputError(f"dataset control_directory {folder} is not a folder")
    free = {p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS}
    found: dict[int, list[Path]] = {}
    for index in sorted(range(len(targets)), key=lambda i: len(targets[i].name), reverse=True):
        stem = targets[index].stem
        mine = [p for p in free if p.name.startswith(stem + ".") or p.name.startswith(stem + "_")]
        free.difference_update(mine)
        found[index] = sorted(mine, key=lambda p: _control_order(p, stem, folder))
    return [found[i] for i in range(len(targets))]


def _control_order(path: Path, stem: str, folder: Path) -> int:
    if path.stem == stem:
        return 0
    suffix = path.stem.rsplit("_", 1)[-1]
    if not suffix.isdigit():
        raise InputError(f"control_directory {folder}: {path.name} matches image {stem!r} but its suffix "
                         f"{suffix!r} is not an index; name controls {stem}.png or {stem}_0.png, {stem}_1.png, ...")
    return int(suffix) + 1


def read_dataset_config(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """``dataset.sources`` items and the batch size of a musubi dataset TOML."""
    path = Path(path)
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"musubi dataset config {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"musubi dataset config {path}: cannot parse: {err}") from None
    unknown = sorted(set(config) - {"general", "datasets"})
    if unknown:
        raise _fail(path, unknown[0], "unknown section (expected [general] and [[datasets]])")
    general = config.get("general", {})
    _check_keys(general, GENERAL_KEYS, path, "general")
    datasets = config.get("datasets", [])
    if not datasets:
        raise _fail(path, "datasets", "no [[datasets]] entries")
    sources, batch_sizes = [], set()
    for i, entry in enumerate(datasets):
        if not isinstance(entry, dict):
            raise _fail(path, f"datasets[{i}]", "expected a [[datasets]] table")
        sources += _sources(entry, general, path, f"datasets[{i}]")
        batch_sizes.add({**DEFAULTS, **general, **entry}["batch_size"])
    if len(batch_sizes) != 1:
        raise _fail(path, "batch_size", f"differs between datasets ({sorted(batch_sizes)}); splitflow trains "
                                        "with one train.batch_size")
    return sources, batch_sizes.pop()


def expand_dataset_config(data: dict[str, Any]) -> dict[str, Any]:
    """Raw config data with a musubi TOML in ``dataset.metadata_path`` expanded into
    ``dataset.sources`` (when it has none yet: a saved, resolved config keeps its sources)."""
    dataset = data.get("dataset") or {}
    metadata = dataset.get("metadata_path")
    if not isinstance(metadata, str) or not metadata.endswith(".toml") or dataset.get("sources"):
        return data
    sources, batch_size = read_dataset_config(metadata)
    data["dataset"] = {**dataset, "sources": sources}
    train = data.setdefault("train", {})
    train.setdefault("batch_size", batch_size)
    return data


# --- Wan training flags (musubi-tuner src/musubi_tuner/wan_train_network.py, wan/configs) -------------

# musubi's --task -> the wan variant; the A14B tasks with --dit_high_noise train both experts in one run.
WAN_TASKS = {"t2v-14B": "t2v", "t2v-1.3B": "t2v", "i2v-14B": "i2v", "t2v-A14B": "t2v-a14b", "i2v-A14B": "i2v-a14b"}
# The one-DiT layout of each A14B task: one T2V expert alone is a Wan2.1-14B-shaped DiT, one I2V expert a
# 36-channel DiT without CLIP.  I2V tasks take each clip's first frame as the image (wan_cache_latents.py --i2v).
_ONE_EXPERT = {"t2v-a14b": "t2v", "i2v-a14b": "i2v-a14b-expert"}
# musubi's model flags -> the component each loads (--clip: Wan2.1 I2V's CLIP, which Wan2.2 does not use)
_MODEL_FLAGS = {"t5": "text_encoder", "vae": "vae", "clip": "image_encoder"}


def wan_training_overrides(flags: dict[str, str], tokenizer: str | Path | None = None) -> list[str]:
    """``section.key=value`` overrides for musubi's Wan model and timestep flags.

    ``--dit`` (the low-noise DiT when ``--dit_high_noise`` gives the high-noise one: both experts in one
    run), ``--t5``, ``--vae``, ``--clip`` (Wan2.1 I2V) -> ``model.sources``; ``--timestep_boundary``
    (0-1000, or a fraction; the task's own by default) -> ``model.boundary_ratio``; ``--min_timestep`` /
    ``--max_timestep`` (0-1000) -> ``train.sigma_range``.  ``tokenizer``: umT5's tokenizer folder (musubi
    fetches it from the hub; splitflow never downloads).  musubi draws one timestep per batch to pick the
    expert and redraws each sample onto its side; splitflow splits the batch instead (docs/training.md,
    "Experts")."""
    task = flags.get("task", "t2v-14B")
    if task not in WAN_TASKS:
        raise InputError(f"musubi --task {task}: splitflow trains the Wan tasks {', '.join(WAN_TASKS)}")
    variant, out = WAN_TASKS[task], ["model.family=wan"]
    if not flags.get("dit"):
        raise InputError("musubi flags: --dit is missing (the DiT checkpoint to train)")
    high = flags.get("dit_high_noise")
    if high and variant not in _ONE_EXPERT:
        raise InputError(f"musubi --dit_high_noise: --task {task} has one DiT; use t2v-A14B or i2v-A14B")
    if not high and variant in _ONE_EXPERT:
        variant = _ONE_EXPERT[variant]  # one expert: its sigmas come from --min/--max_timestep
    sources = {"transformer": high or flags["dit"]}
    if high:
        sources["transformer_2"] = flags["dit"]
    sources.update(_model_files(flags, variant, task))
    if tokenizer is not None:
        sources["tokenizer"] = str(tokenizer)
    out.append(f"model.variant={variant!r}")
    table = ", ".join(f"{name} = [{str(Path(path).absolute())!r}]" for name, path in sources.items())
    out.append(f"model.sources={{{table}}}")
    if flags.get("timestep_boundary") is not None:
        out.append(f"model.boundary_ratio={_fraction(flags['timestep_boundary'], '--timestep_boundary')}")
    if flags.get("min_timestep") is not None or flags.get("max_timestep") is not None:
        low = _fraction(flags.get("min_timestep", "0"), "--min_timestep", whole=True)
        top = _fraction(flags.get("max_timestep", "1000"), "--max_timestep", whole=True)
        out.append(f"train.sigma_range=[{low}, {top}]")
    return out


def _model_files(flags: dict[str, str], variant: str, task: str) -> dict[str, str]:
    """The encoders' files the flags give, those the variant loads; a CLIP the variant needs but lacks is refused,
    as musubi refuses it ("CLIP path is required for I2V training")."""
    from diffsynth_core.models import get_family

    wanted = get_family("wan", variant).encoder_components
    if "image_encoder" in wanted and not flags.get("clip"):
        raise InputError(f"musubi --task {task}: --clip is missing (Wan2.1 I2V's "
                         "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth)")
    return {name: flags[flag] for flag, name in _MODEL_FLAGS.items() if flags.get(flag) and name in wanted}


def _fraction(raw: str, flag: str, whole: bool = False) -> float:
    """A timestep (0-1000; musubi divides one above 1 by 1000) as a sigma in [0, 1]."""
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"musubi {flag} {raw!r} is not a number") from None
    value = value / 1000.0 if whole or value > 1 else value
    if not 0 <= value <= 1 or (flag == "--timestep_boundary" and value in (0, 1)):
        raise InputError(f"musubi {flag} {raw}: the boundary must lie inside (0, 1000) (or (0, 1) as a fraction)"
                         if flag == "--timestep_boundary" else f"musubi {flag} {raw} must lie in [0, 1000]")
    return value
