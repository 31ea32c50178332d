"""Reference images of a row (edit references, control images): where rows name them, and their sizes.

Column conventions, in the order a row's references are listed:

* ``edit_image`` (DiffSynth-Studio, diffsynth/core/data/unified_dataset.py): one path (Edit v1), or a
  list of paths (Edit-2509/2511) -- in a CSV cell, a JSON list such as ``["a.png", "b.png"]``;
* ``cond_image`` (diffusers training scripts' conditioning-image column): one path or a list;
* ``control_path``, ``control_path_0`` .. ``control_path_N`` (musubi-tuner, src/musubi_tuner/dataset/
  datasources.py ``ImageJsonlDatasource``: ``control_path`` is ``control_path_0``; the indices sort
  as numbers, so ``control_path_0010`` comes after ``control_path_2``).

Sizes follow diffusers' ``calculate_dimensions`` (pipelines/qwenimage/pipeline_qwenimage_edit_plus.py):
an image of aspect ``w/h`` becomes about ``area`` pixels, each side rounded to a multiple, and is
resized to it (Lanczos, no crop) as ``VaeImageProcessor.resize`` does.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from PIL import Image

REFERENCE_COLUMNS = ("edit_image", "cond_image", "control_path")
_CONTROL_INDEXED = re.compile(r"^control_path_(\d+)$")
# How a dataset source sizes its references for the VAE (``dataset.reference_size``):
# "family": the family's rule (ReferenceRule.vae_area, or ``reference_pixels`` instead);
# "target": the target's size (musubi-tuner's default: controls resized to the target's bucket);
# "own": the image's own size floored to the multiple, at most ``reference_pixels`` (no_resize_control).
REFERENCE_SIZES = ("family", "target", "own")


def is_reference_column(name: str) -> bool:
    return name in REFERENCE_COLUMNS or bool(_CONTROL_INDEXED.match(name))


def reference_columns(row: dict[str, Any]) -> list[str]:
    """The reference columns ``row`` has, in listing order."""
    indexed = sorted((int(m.group(1)), k) for k in row if (m := _CONTROL_INDEXED.match(k)))
    return [k for k in REFERENCE_COLUMNS if k in row] + [k for _, k in indexed]


class ReferenceCellError(ValueError):
    """A reference cell that is neither a path nor a list of paths (the column is in ``column``)."""

    def __init__(self, column: str, message: str):
        super().__init__(message)
        self.column = column


def reference_cells(row: dict[str, Any]) -> list[tuple[str, str]]:
    """(column, path) of each reference ``row`` names, in order; empty cells and empty lists give none."""
    out = []
    for column in reference_columns(row):
        value = row[column]
        if isinstance(value, str) and value.lstrip().startswith("["):  # a JSON list in a CSV cell
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ReferenceCellError(column, f"column {column!r} holds {_short(value)}, which is not a valid "
                                                 f"JSON list ({e.msg}); write it as [\"a.png\", \"b.png\"]") from None
        if value is None or value == "":
            continue
        values = value if isinstance(value, list) else [value]
        for item in values:
            if not isinstance(item, str) or not item:
                raise ReferenceCellError(column, f"column {column!r} must hold a file path or a list of them, "
                                                 f"got {_short(value)}")
            out.append((column, item))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def area_size(height: int, width: int, area: int, multiple: int) -> tuple[int, int]:
    """(height, width) of about ``area`` pixels with the aspect of ``width/height``, each side a multiple of
    ``multiple`` (diffusers' ``calculate_dimensions``: rounded, not floored; never below one multiple)."""
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    new_height = new_width / ratio
    return (max(multiple, round(new_height / multiple) * multiple),
            max(multiple, round(new_width / multiple) * multiple))


def floored_size(height: int, width: int, multiple: int) -> tuple[int, int]:
    return max(multiple, height // multiple * multiple), max(multiple, width // multiple * multiple)


def resized(image: Image.Image, height: int, width: int) -> Image.Image:
    """``image`` at exactly height x width, stretched (Lanczos), as diffusers' VaeImageProcessor.resize."""
    if image.size == (width, height):
        return image
    return image.resize((width, height), Image.Resampling.LANCZOS)
