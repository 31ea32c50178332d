"""Model families: a registry mapping names to :class:`FamilySpec` objects.

Each family module exposes ``SPEC``; modules are imported lazily so that importing
``diffsynth_core`` does not pull in diffusers/transformers.
"""

from __future__ import annotations

import importlib

from .base import Components, FamilySpec

# family name -> module under diffsynth_core.models
_FAMILY_MODULES = {
    "qwen_image": "qwen_image",
    "flux": "flux",
    "wan": "wan",
}


def known_families() -> list[str]:
    return sorted(_FAMILY_MODULES)


def get_family(name: str) -> FamilySpec:
    """Return the spec of family ``name``; unknown names list the known ones."""
    if name not in _FAMILY_MODULES:
        raise KeyError(f"unknown model family {name!r}; known families: {', '.join(known_families())}")
    module = importlib.import_module(f"{__name__}.{_FAMILY_MODULES[name]}")
    return module.SPEC


__all__ = ["Components", "FamilySpec", "get_family", "known_families"]
