"""Cache entries -> one batch of tensors: stacking, padding of variable-length prompts, caption dropout.

Entries of one batch share their latent shape and their reference latents' shapes (the sampler
buckets them), so latents and ``ref_latents_<i>`` stack as they are.  Prompt-side tensors whose length differs between prompts are named by the family
(``FamilySpec.batch_padding``: tensor -> mask): both are zero-padded on dim 0 to the batch's
longest, the mask's padding being 0, which the DiT's attention then ignores.
"""

from __future__ import annotations

import math

from typing import Any, Hashable, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..errors import InputError


def latent_shapes(samples: Sequence[Mapping[str, Any]]) -> list[Hashable]:
    """Each sample's bucket: its latent shape, frames included (and its reference latents' shapes).

    Training sets that can tell a shape without reading the tensors (``samples.latent_shape(i)``,
    e.g. from the cache's manifest) are asked; others are read.
    """
    if hasattr(samples, "latent_shape"):
        return [tuple(samples.latent_shape(i)) for i in range(len(samples))]
    return [_bucket(samples[i]) for i in range(len(samples))]


def _bucket(entry: Mapping[str, Any]) -> Hashable:
    """The latent shape, then each reference's (``ref_latents_<i>``) when there are any: samples with
    other reference counts or sizes never share a batch."""
    latents = tuple(entry["latents"].shape)
    references, i = [], 0
    while isinstance(entry.get(f"ref_latents_{i}"), torch.Tensor):
        references.append(tuple(entry[f"ref_latents_{i}"].shape))
        i += 1
    return (latents, *references) if references else latents


def sequence_shape(bucket: Hashable) -> tuple[int, ...]:
    """A bucket as one latent shape: the target's ``(C, f, h, w)``, or, with references, ``(C, 1, 1,
    positions)`` counting the target's positions and its references', which the DiT's sequence holds
    together (what activation planning reads)."""
    if not bucket or not isinstance(bucket[0], tuple):
        return tuple(bucket)
    positions = sum(math.prod(shape[1:]) for shape in bucket)
    return (bucket[0][0], 1, 1, positions)


def with_empty_prompt(entry: Mapping[str, Any], empty_prompt: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``entry`` with its prompt-side tensors replaced by the empty prompt's (caption dropout)."""
    return {**entry, **{k: v for k, v in empty_prompt.items() if isinstance(v, torch.Tensor)}}


def _pad_to(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``tensor`` to ``length``."""
    pad = [0, 0] * (tensor.ndim - 1) + [0, length - tensor.shape[0]]
    return F.pad(tensor, pad)


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
              non_blocking: bool = False) -> dict[str, torch.Tensor]:
    """``batch`` on ``device`` (``non_blocking``: its host tensors are pinned), floating tensors cast
    to ``dtype`` there."""
    moved = {}
    for name, tensor in batch.items():
        tensor = tensor.to(device, non_blocking=non_blocking)
        moved[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return moved


def stack_entries(entries: Sequence[Mapping[str, Any]], padding: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The tensors of ``entries`` stacked along a new batch dim, on the host, in their cached dtypes."""
    names = [k for k, v in entries[0].items() if isinstance(v, torch.Tensor)]
    padded = set(padding) | set(padding.values())
    batch = {}
    for name in names:
        tensors = [_field(entry, name, i) for i, entry in enumerate(entries)]
        if name in padded:
            longest = max(t.shape[0] for t in tensors)
            mask = padding.get(name)
            if mask is not None and mask not in names and any(t.shape[0] != longest for t in tensors):
                # padding without a mask would feed the zeros to the DiT as prompt tokens
                meta = entries[0].get("meta") or {}
                first = f"row {meta['row']}" if "row" in meta else meta.get("source", "?")
                raise InputError(f"cache entries of different {name!r} lengths hold no {mask!r} to pad them with "
                                 f"(the batch of {first}); re-import or re-run preprocess, or set train.batch_size = 1")
            tensors = [_pad_to(t, longest) for t in tensors]
        elif len({t.shape for t in tensors}) > 1:
            shapes = sorted({tuple(t.shape) for t in tensors})
            raise InputError(f"cannot batch entries whose {name!r} shapes differ ({shapes}); this family pads no "
                             f"{name!r}: re-run preprocess with one prompt length, or set train.batch_size = 1")
        batch[name] = torch.stack(tensors)
    return batch


def _field(entry: Mapping[str, Any], name: str, position: int) -> torch.Tensor:
    value = entry.get(name)
    if not isinstance(value, torch.Tensor):
        row = (entry.get("meta") or {}).get("row", "?")
        raise InputError(f"cache entry of row {row} has no tensor {name!r} that other entries of its batch have "
                         f"(entry {position} of the batch); re-run preprocess")
    return value
