"""Dataset: CSV/JSON/JSONL metadata, image and video loading, crop-and-resize rules.

    from diffsynth_core.data import SampleDataset
    ds = SampleDataset("data/metadata.csv", max_pixels=512 * 512)
    sample = ds.load(0)   # Sample(pixels=(3, 1, H, W) float32 in [-1, 1], fields={"prompt": ...})

Torch, numpy, pandas, Pillow and imageio only.
"""

from .dataset import PIXELS_VERSION, Sample, SampleDataset
from .errors import DatasetError
from .media import MEDIA_EXTENSIONS, usable_frame_count
from .metadata import PROMPT_COLUMNS, load_metadata
from .resize import crop_and_resize, crop_and_resize_size

__all__ = [
    "DatasetError", "MEDIA_EXTENSIONS", "PIXELS_VERSION", "PROMPT_COLUMNS", "Sample",
    "SampleDataset", "crop_and_resize", "crop_and_resize_size", "load_metadata",
    "usable_frame_count",
]
