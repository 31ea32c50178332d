"""Weight streaming for training and inference: units, pinned arena, copy stream + prefetch,
optimizer offload, optimizer state in host memory.  Importable with torch alone."""

from .backward_steps import StepInBackward
from .manager import OffloadTrainingManager
from .optimizer_state import HostOptimizerState

__all__ = ["HostOptimizerState", "OffloadTrainingManager", "StepInBackward"]
