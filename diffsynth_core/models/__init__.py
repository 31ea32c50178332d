"""Model families: a registry mapping names to :class:`FamilySpec` objects.

Each family module exposes ``SPEC``; modules are imported lazily so that importing
``diffsynth_core`` does not pull in diffusers/transformers.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

from ..errors import InputError
from .base import Components, Expert, FamilySpec, ReferenceRule
from .loading import read_model_index_file

# family name -> module under diffsynth_core.models
_FAMILY_MODULES = {
    "qwen_image": "qwen_image",
    "flux": "flux",
    "wan": "wan",
    "z_image": "z_image",
    "qwen_image21": "qwen_image21",
    "flux2": "flux2",
}


def known_families() -> list[str]:
    return sorted(_FAMILY_MODULES)


class UnknownFamilyError(InputError, KeyError):
    """``model.family`` names no registered family (a KeyError too, for callers that caught that)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def get_family(name: str, variant: str | None = None) -> FamilySpec:
    """Return the spec of family ``name`` (with ``variant``'s fields applied, if given); unknown
    names list the known ones."""
    if name not in _FAMILY_MODULES:
        raise UnknownFamilyError(f"model.family = {name!r} is not a known model family; "
                                 f"use one of: {', '.join(known_families())}")
    module = importlib.import_module(f"{__name__}.{_FAMILY_MODULES[name]}")
    return with_variant(module.SPEC, variant)


def with_variant(spec: FamilySpec, variant: str | None) -> FamilySpec:
    """``spec`` with the fields ``variant`` replaces; None: the spec as it is."""
    if variant is None or variant == spec.variant:
        return spec
    if variant not in spec.variants:
        known = ", ".join(sorted(spec.variants)) or "none"
        raise InputError(f"model.variant = {variant!r} is not a variant of {spec.name} (its variants: {known})")
    return dataclasses.replace(spec, **spec.variants[variant], variant=variant)


def check_model_folder(spec: FamilySpec, path: str | Path) -> None:
    """Refuse a diffusers model folder made for another family, naming both (before any weight loads).

    ``model_index.json``'s ``_class_name`` names the pipeline the folder is for; loading it as another
    family otherwise fails deep inside diffusers (TypeError, AttributeError) or, worse, half-works.
    Folders without a model_index.json (single released files) are not checked here.
    """
    index_file = Path(path) / "model_index.json"
    if not index_file.is_file():
        return
    pipeline = read_model_index_file(Path(path)).get("_class_name")
    if pipeline is None or pipeline == spec.pipeline_class_name:
        return
    matching = [(name, None) for name in known_families() if get_family(name).pipeline_class_name == pipeline]
    matching += [(name, variant) for name in known_families() for variant in get_family(name).variants
                 if get_family(name, variant).pipeline_class_name == pipeline]
    if matching and matching[0][0] == spec.name:
        hint = f"set model.variant = {matching[0][1]!r}" if matching[0][1] else "leave model.variant unset"
    elif matching:
        hint = f"set model.family = {matching[0][0]!r}"
    else:
        hint = "use a model folder of this family"
    raise InputError(f"model.path {path} holds a {pipeline} model, but model.family = {spec.name!r} "
                     f"expects a {spec.pipeline_class_name}: {hint}")


__all__ = ["Components", "Expert", "FamilySpec", "ReferenceRule", "with_variant", "UnknownFamilyError", "check_model_folder", "get_family", "known_families"]
