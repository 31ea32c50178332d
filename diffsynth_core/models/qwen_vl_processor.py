"""Qwen2.5-VL's processor for still images: the edit pipelines' ``processor`` component.

``Qwen2VLProcessor`` tokenises the prompt, expands each ``<|image_pad|>`` to the image's patch
count and turns the images into patches.  transformers builds it with a video processor, which
needs torchvision; prompts of image edits never hold videos, so here it is built without one
(the image processor is the one the folder names, whichever backend transformers has).  The
folder it reads and writes is the release's ``processor/``: tokenizer files plus
``preprocessor_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

PROCESSOR_CLASS = "Qwen2VLProcessor"


def _processor_cls():
    from transformers import Qwen2VLProcessor

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` that accepts no video processor (images only, no torchvision)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageQwen2VLProcessor


def build_processor(tokenizer, image_processor=None):
    """The processor over ``tokenizer`` (which must hold the vision tokens) and an image processor
    (Qwen2-VL's defaults: 14-pixel patches merged 2x2)."""
    if image_processor is None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil()
    return _processor_cls()(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                            chat_template=getattr(tokenizer, "chat_template", None))


def load_processor(folder: Path):
    """The processor saved in ``folder`` (a release's ``processor/``); one line naming it if it is not one."""
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = Path(folder)
    if not (folder / "preprocessor_config.json").is_file():
        raise InputError(f"{folder} holds no preprocessor_config.json: point the processor at the edit release's "
                         "processor/ folder (e.g. Qwen/Qwen-Image-Edit-2509/processor)")
    try:
        return build_processor(AutoTokenizer.from_pretrained(str(folder)), AutoImageProcessor.from_pretrained(str(folder)))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot load the processor in {folder} ({exc}); copy the release's processor/ again") from exc


def save_processor(processor, folder: Path) -> None:
    """Write ``processor`` as a release's ``processor/`` folder (what ``Qwen2VLProcessor.from_pretrained`` reads)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    processor.tokenizer.save_pretrained(str(folder))
    processor.image_processor.save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": PROCESSOR_CLASS}, indent=2))
