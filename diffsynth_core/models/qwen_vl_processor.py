"""Qwen-VL processors for still images: the ``processor`` component of the edit pipelines (Qwen2.5-VL's
``Qwen2VLProcessor``) and of Qwen-Image-2.1 (``Qwen3VLProcessor``).

A processor tokenises the prompt, expands each ``<|image_pad|>`` to the image's patch count and
turns the images into patches.  transformers builds it with a video processor, which needs
torchvision; prompts of image models never hold videos, so here it is built without one (the
image processor is the one the folder names, whichever backend transformers has).  The folder it
reads and writes is the release's ``processor/``: tokenizer files, ``preprocessor_config.json``
and a ``processor_config.json`` naming the class (Qwen2VLProcessor where it names none).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

PROCESSOR_CLASS = "Qwen2VLProcessor"
QWEN3_PROCESSOR_CLASS = "Qwen3VLProcessor"
# transformers class each processor name is built on (Qwen2.5-VL's folders name either).
_BASES = {"Qwen2VLProcessor": "Qwen2VLProcessor", "Qwen2_5_VLProcessor": "Qwen2VLProcessor",
          QWEN3_PROCESSOR_CLASS: QWEN3_PROCESSOR_CLASS}


def _processor_cls(name: str = PROCESSOR_CLASS):
    import transformers

    base = getattr(transformers, _BASES[name])

    class ImageOnlyProcessor(base):
        """The processor with no video processor (images only, no torchvision)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyProcessor


def build_processor(tokenizer, image_processor=None, class_name: str = PROCESSOR_CLASS, chat_template=None):
    """The processor over ``tokenizer`` (which must hold the vision tokens) and an image processor
    (Qwen2-VL's defaults: 14-pixel patches merged 2x2)."""
    if image_processor is None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil()
    return _processor_cls(class_name)(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                      chat_template=chat_template or getattr(tokenizer, "chat_template", None))


def _class_name(folder: Path) -> str:
    """The processor class the folder names (processor_config.json, else preprocessor_config.json)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            named = json.loads((folder / name).read_text()).get("processor_class")
        except (OSError, ValueError, AttributeError):
            continue
        if named in _BASES:
            return named
    return PROCESSOR_CLASS


def _chat_template(folder: Path) -> str | None:
    """A processor-level chat template (chat_template.json or .jinja), which the tokenizer may not load."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None


def load_processor(folder: Path):
    """The processor saved in ``folder`` (a release's ``processor/``); one line naming it if it is not one."""
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = Path(folder)
    if not (folder / "preprocessor_config.json").is_file():
        raise InputError(f"{folder} holds no preprocessor_config.json: point the processor at the release's "
                         "processor/ folder (e.g. Qwen/Qwen-Image-Edit-2509/processor, Qwen/Qwen-Image-2.1/processor)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return build_processor(tokenizer, AutoImageProcessor.from_pretrained(str(folder)), _class_name(folder),
                               getattr(tokenizer, "chat_template", None) or _chat_template(folder))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot load the processor in {folder} ({exc}); copy the release's processor/ again") from exc


def save_processor(processor, folder: Path, class_name: str = PROCESSOR_CLASS) -> None:
    """Write ``processor`` as a release's ``processor/`` folder (what the processor's ``from_pretrained`` reads)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    processor.tokenizer.save_pretrained(str(folder))
    processor.image_processor.save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": class_name}, indent=2))
