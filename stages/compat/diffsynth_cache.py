"""``splitflow cache import``: a DiffSynth-Studio split-training cache becomes a splitflow cache.

DiffSynth's ``sft:data_process`` task pickles each sample's pipeline inputs as
``<output_path>/<rank>/<i>.pth``; which inputs a family's stage 2 reads, and under which
names, is the family's ``diffsynth_cache_fields`` (read from DiffSynth's pipeline units).  The
family is recognised from the first file's tensors unless given.  The copy itself (allow-listed
unpickling, content keys, resumable) is ``cache_store.diffsynth``.
"""

from __future__ import annotations

from typing import Any

from cache_store.diffsynth import diffsynth_files, import_diffsynth_cache, load_diffsynth_file, tensor_names
from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family, known_families


def _required(family: str) -> set[str]:
    """The DiffSynth inputs every sample of ``family`` holds (per-item lists such as edit latents are not)."""
    return {name for name, target in get_family(family).diffsynth_cache_fields.items() if "{i}" not in target}


def detect_family(src: str) -> str:
    """The family whose DiffSynth inputs are all among the first cached sample's tensors; where several
    are (Z-Image's inputs are a subset of Qwen-Image-2.1's), the one whose inputs hold all the others'."""
    first = diffsynth_files(src)[0]
    names = tensor_names(load_diffsynth_file(first), str(first))
    matches = [f for f in known_families() if _required(f) and _required(f) <= names]
    matches = [f for f in matches if all(_required(other) <= _required(f) for other in matches)]
    if len(matches) != 1:
        raise InputError(f"{first}: cannot tell the model family from its tensors {sorted(names)} "
                         f"(matches {matches or 'none'}); pass --family ({', '.join(known_families())})")
    return matches[0]


def import_cache(src: str, dest: str, family: str | None = None, backend: str | None = None) -> dict[str, Any]:
    """Import ``src`` into the cache at ``dest`` for ``family`` (detected when None)."""
    if family is not None and family not in known_families():
        raise InputError(f"--family {family!r}: unknown; known families: {', '.join(known_families())}")
    family = family or detect_family(src)
    spec = get_family(family)
    fields = dict(spec.diffsynth_cache_fields)
    # Masks of padded fields that DiffSynth does not store are filled in (all ones: one sample a file).
    masks = {name: mask for name, mask in spec.batch_padding.items() if mask not in fields.values()}
    if not fields:  # FLUX.2: DiffSynth caches packed tokens without their grid
        raise InputError(f"--family {family}: DiffSynth-Studio's {family} caches cannot be imported; encode the "
                         "dataset with `splitflow preprocess` instead")
    summary = import_diffsynth_cache(src, dest, backend=backend, rename=fields, only_renamed=True,
                                     fingerprint=f"diffsynth-import:{family}", family=family, masks=masks)
    summary["family"] = family
    return summary
