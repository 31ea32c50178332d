"""Validation images during training: the family's diffusers pipeline with the live DiT.

Every ``train.validation_steps`` optimizer steps, each prompt of ``train.validation_prompts`` is
rendered with the current weights (LoRA included) and saved as
``<output>/validation/step-<N>-<i>.png``.  Generation draws from its own seeded generator and
restores the global RNG afterwards, so validation never changes the training run.  A family that
takes reference images (an edit model) renders an edit of the first dataset row's references.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from diffsynth_core.models import FamilySpec

from .common import model_dtype
from .config import RunConfig

log = logging.getLogger(__name__)


def _first_image(output) -> Image.Image:
    if getattr(output, "images", None) is not None:
        return output.images[0]
    frames = output.frames[0]  # video pipelines: (F, H, W, C) floats in [0, 1] or PIL frames
    first = frames[0]
    if isinstance(first, Image.Image):
        return first
    return Image.fromarray((np.asarray(first) * 255).round().clip(0, 255).astype(np.uint8))


def to_image(pixels: torch.Tensor) -> Image.Image:
    """A reference ``(3 or 4, 1, H, W)`` in ``[-1, 1]`` as the RGB (RGBA: alpha kept) image a pipeline takes."""
    values = ((pixels[:, 0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(values.permute(1, 2, 0).numpy(), "RGBA" if values.shape[0] == 4 else "RGB")


def first_references(dataset, rows: int = 16) -> list[Image.Image]:
    """The reference images of the first of the dataset's first ``rows`` rows that has any (none: [])."""
    for index in range(min(rows, len(dataset))):
        sample = dataset[index]
        if sample is not None and getattr(sample, "references", None):
            return [to_image(ref) for ref in sample.references]
    return []


def validation_references(cfg: RunConfig, spec: FamilySpec) -> list[Image.Image]:
    """What validation edits: the first dataset row's references, for families that take them."""
    if spec.references is None:
        return []
    from .datasets import open_dataset

    return first_references(open_dataset(cfg.dataset, spec))


class ValidationRenderer:
    def __init__(self, cfg: RunConfig, spec: FamilySpec, size: tuple[int, int], num_frames: int = 1,
                 references: list[Image.Image] = ()):
        self.cfg, self.spec, self.size = cfg, spec, size
        # Video pipelines default to long clips (Wan: 81 frames); render as many as we train on.
        self.extra_kwargs = {"num_frames": num_frames} if spec.frame_multiple > 1 else {}
        if references:  # an edit: Edit v1's pipeline takes one image, the others a list
            one = spec.references.max_count == 1
            self.extra_kwargs["image"] = references[0] if one else list(references)
        self.folder = cfg.output_dir / "validation"
        self._pipe = None

    def _pipeline(self, transformer: torch.nn.Module):
        if self._pipe is None:
            import diffusers

            pipeline_class = getattr(diffusers, self.spec.pipeline_class_name)
            # The tokenizer and a VL processor load as the family loads them: transformers' own processors
            # (Qwen2-VL's, FLUX.2-dev's Pixtral) want torchvision.
            names = tuple(n for n in ("processor", "tokenizer") if n in self.spec.encoder_components)
            extra = self.spec.load_components(Path(self.cfg.model.path), names, model_dtype(self.cfg), "cpu")
            self._pipe = pipeline_class.from_pretrained(self.cfg.model.path, transformer=transformer,
                                                        dtype=model_dtype(self.cfg), **extra)
        return self._pipe

    def __call__(self, step: int, model: torch.nn.Module) -> list[Path]:
        train = self.cfg.train
        if not train.validation_prompts or not train.validation_steps or step % train.validation_steps:
            return []
        pipe = self._pipeline(model)
        self.folder.mkdir(parents=True, exist_ok=True)
        height, width = self.size
        saved = []
        was_training = model.training
        model.eval()
        with torch.random.fork_rng(), torch.no_grad():
            for index, prompt in enumerate(train.validation_prompts):
                generator = torch.Generator().manual_seed(train.seed + index)
                output = pipe(prompt=prompt, height=height, width=width, generator=generator,
                              num_inference_steps=train.validation_inference_steps, **self.extra_kwargs)
                path = self.folder / f"step-{step:08d}-{index}.png"
                _first_image(output).save(path)
                saved.append(path)
        model.train(was_training)
        log.info("validation images: %s", ", ".join(str(p) for p in saved))
        return saved
