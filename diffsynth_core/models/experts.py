"""The boundary between two experts, as a diffusers folder records it.

Two-stage diffusers pipelines (``WanPipeline`` with ``transformer_2``) store ``boundary_ratio`` in
``model_index.json``: ``transformer`` serves ``t >= boundary_ratio * num_train_timesteps``, i.e.
sigma >= boundary_ratio, and ``transformer_2`` the rest.  A family's spec carries the release's
boundary; a folder that says otherwise wins.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import InputError
from .base import FamilySpec


def with_folder_boundary(spec: FamilySpec, path: str | Path | None, ratio: float | None = None) -> FamilySpec:
    """``spec`` with its two experts split at ``ratio`` (``model.boundary_ratio``), else at the folder's
    ``boundary_ratio`` (where it gives one)."""
    index = Path(path) / "model_index.json" if path else None
    if len(spec.experts) != 2:
        return spec
    if ratio is None and index is not None and index.is_file():
        ratio = json.loads(index.read_text()).get("boundary_ratio")
    if ratio is None:
        return spec
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise InputError(f"{index}: boundary_ratio = {ratio!r} must lie strictly between 0 and 1 (the sigma "
                         "where the second expert takes over); correct the file")
    high, low = spec.experts
    return dataclasses.replace(spec, experts=(dataclasses.replace(high, sigma_min=float(ratio)),
                                              dataclasses.replace(low, sigma_max=float(ratio))))
