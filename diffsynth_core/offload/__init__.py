"""Weight streaming for training and inference: units, pinned arena, copy stream + prefetch,
optimizer offload.  Importable with torch alone."""

from .manager import OffloadTrainingManager

__all__ = ["OffloadTrainingManager"]
