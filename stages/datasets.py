"""The training data a config names: a metadata file, a caption folder, or several sources.

``dataset.metadata_path`` may be a CSV/JSON/JSONL file (musubi-tuner's ``image_path``/
``video_path`` keys accepted), or a folder of media with same-name caption files (kohya /
musubi-tuner, ``dataset.caption_extension``; ``<repeats>_<name>`` subfolders repeat).
``dataset.sources`` lists several such datasets, each with its own repeats and size rule (a
musubi dataset TOML is expanded into them when the config is read); they are trained as one,
each row repeated its source's number of times (docs/datasets.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from diffsynth_core.data import SampleDataset, load_metadata
from diffsynth_core.data.sources import ConcatSamples
from diffsynth_core.errors import InputError
from diffsynth_core.models import FamilySpec

from .compat.kohya import folder_sources
from .compat.musubi import control_images, with_musubi_keys
from .config import DatasetSection, DatasetSource


def open_dataset(section: DatasetSection, spec: FamilySpec) -> SampleDataset | ConcatSamples:
    if section.sources:
        sources = section.sources
    elif section.metadata_path:
        sources = [DatasetSource(metadata_path=section.metadata_path, base_path=section.base_path)]
    else:
        raise InputError("dataset.metadata_path is empty: point it at a metadata.csv/.json/.jsonl file, a folder "
                         "of images with captions, or a musubi-tuner dataset .toml")
    # Each source's (and kohya folder's) own repeats; dataset.repeat multiplies everything on top
    # of them in the sampler (stages.train, stages.status), not here.
    parts = [pair for source in sources for pair in _open_source(section, source, spec)]
    if len(parts) == 1 and parts[0][1] == 1:
        return parts[0][0]
    return ConcatSamples(parts)


def _size_rule(section: DatasetSection, source: DatasetSource) -> dict:
    if source.height is not None or source.width is not None:
        return {"height": source.height, "width": source.width, "max_pixels": section.max_pixels}
    if source.max_pixels is not None:
        return {"height": None, "width": None, "max_pixels": source.max_pixels}
    return {"height": section.height, "width": section.width, "max_pixels": section.max_pixels}


def _reference_options(section: DatasetSection, source: DatasetSource, spec: FamilySpec) -> dict:
    """The family's reference rule and this source's sizing of references (docs/datasets.md)."""
    references = spec.references
    if references is not None and section.first_frame_reference:
        references = dataclasses.replace(references, first_frame_of_target=True)
    return {"references": references,
            "reference_size": source.reference_size or section.reference_size,
            "reference_pixels": source.reference_pixels or section.reference_pixels,
            "reference_roots": [source.control_directory] if source.control_directory else []}


def _open_source(section: DatasetSection, source: DatasetSource, spec: FamilySpec) -> list[tuple[SampleDataset, int]]:
    options = dict(data_file_keys=tuple(section.data_file_keys), frame_multiple=spec.frame_multiple,
                   num_frames=source.num_frames or section.num_frames, skip_bad_samples=section.skip_bad_samples,
                   background=section.background, allow_external_paths=section.allow_external_paths,
                   stills_only=spec.frame_multiple == 1,  # image families (base.py: "image families use 1")
                   alpha=spec.vae_rgba, division=spec.pixel_multiple,  # Qwen-Image-2.1: RGBA, multiples of 32
                   **_size_rule(section, source), **_reference_options(section, source, spec))
    path = Path(source.metadata_path)
    if path.is_dir():
        caption_extension = source.caption_extension or section.caption_extension
        return [(SampleDataset(f.folder, f.folder, records=_with_controls(f.records, f.folder, source), **options),
                 f.repeat * source.repeat)
                for f in folder_sources(path, caption_extension)]
    records = with_musubi_keys(load_metadata(path))
    base_path = source.base_path or section.base_path or None
    folder = Path(base_path) if base_path else path.parent
    return [(SampleDataset(path, base_path, records=_with_controls(records, folder, source), **options),
             source.repeat)]


def _with_controls(records: list[dict], folder: Path, source: DatasetSource) -> list[dict]:
    """Rows with the same-stem images of ``source.control_directory`` as ``control_path_<i>`` (musubi-tuner)."""
    if not source.control_directory:
        return records
    out = []
    controls = control_images(Path(source.control_directory), [folder / _target(row) for row in records])
    for row, paths in zip(records, controls):
        out.append({**row, **{f"control_path_{i}": str(p) for i, p in enumerate(paths)}})
    return out


def _target(row: dict) -> str:
    return str(row.get("image") or row.get("video") or "")
