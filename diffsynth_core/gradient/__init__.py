"""Offload-aware, per-block gradient checkpointing.  Importable with torch alone."""

from .checkpoint import apply_gradient_checkpointing, remove_gradient_checkpointing

__all__ = ["apply_gradient_checkpointing", "remove_gradient_checkpointing"]
