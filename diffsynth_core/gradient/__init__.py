"""Offload-aware, per-block gradient checkpointing.  Importable with torch alone."""

from .checkpoint import activation_offloader, apply_gradient_checkpointing, remove_gradient_checkpointing

__all__ = ["activation_offloader", "apply_gradient_checkpointing", "remove_gradient_checkpointing"]
