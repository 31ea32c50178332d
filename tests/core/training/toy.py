"""A tiny DiT-shaped model and FamilySpec for engine tests that need no diffusers."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from diffsynth_core.models.base import FamilySpec


class ToyBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.mod = nn.Linear(width, width)

    def forward(self, x, cond):
        return x + torch.tanh(self.proj(x)) * self.mod(cond)


class ToyDiT(nn.Module):
    """Latents (B, C, H, W) -> tokens (B, HW, C); text (B, L, C) pooled into the conditioning."""

    def __init__(self, channels: int = 4, width: int = 16, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(channels, width)
        self.time = nn.Linear(1, width)
        self.text = nn.Linear(channels, width)
        self.transformer_blocks = nn.ModuleList(ToyBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, channels)

    @property
    def dtype(self) -> torch.dtype:
        return self.inp.weight.dtype

    def enable_gradient_checkpointing(self):  # the trainer's fallback path
        pass

    def forward(self, latents, sigmas, prompt_embeds, prompt_mask=None):
        b, c, h, w = latents.shape
        tokens = self.inp(latents.flatten(2).transpose(1, 2))
        text = self.text(prompt_embeds)
        if prompt_mask is None:
            pooled = text.mean(1, keepdim=True)
        else:  # padded prompts: the mean over real tokens only
            weights = prompt_mask.to(text.dtype).unsqueeze(-1)
            pooled = (text * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True)
        cond = self.time(sigmas.view(b, 1, 1).to(tokens.dtype)) + pooled
        for block in self.transformer_blocks:
            tokens = block(tokens, cond)
        return self.out(tokens).transpose(1, 2).reshape(b, c, h, w)


def _toy_forward(model, latents, sigmas, cond):
    return model(latents, sigmas, cond["prompt_embeds"])


def _toy_forward_masked(model, latents, sigmas, cond):
    return model(latents, sigmas, cond["prompt_embeds"], cond["prompt_mask"])


def _unused(*args, **kwargs):
    raise NotImplementedError("the toy family has no files")


TOY_SPEC = FamilySpec(
    name="toy", encoder_components=(), transformer_component="transformer",
    block_container_names=("transformer_blocks",), lora_target_modules=("proj", "mod"), frame_multiple=1,
    load_components=_unused, load_transformer_file=_unused, encode_prompt=_unused, encode_pixels=_unused,
    dit_forward=_toy_forward, export_lora=_unused, save_tiny_model=_unused, pipeline_class_name="",
)


def toy_samples(n: int = 6, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"latents": torch.randn(4, 4, 4, generator=generator),
             "prompt_embeds": torch.randn(3 + i % 2, 4, generator=generator),
             "meta": {"row": i}} for i in range(n)]


# Prompts of different lengths, padded with their mask in batches (like Qwen-Image).
TOY_PADDED_SPEC = replace(TOY_SPEC, name="toy_padded", dit_forward=_toy_forward_masked,
                          batch_padding={"prompt_embeds": "prompt_mask"})


def mixed_toy_samples(n: int = 10, seed: int = 0) -> list[dict]:
    """Two latent shapes (buckets: (4, 4, 4) for even rows, (4, 4, 6) for odd ones), prompts of 2-4 tokens."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = 2 + i % 3
        samples.append({"latents": torch.randn(4, 4, 4 + 2 * (i % 2), generator=generator),
                        "prompt_embeds": torch.randn(length, 4, generator=generator),
                        "prompt_mask": torch.ones(length, dtype=torch.long), "meta": {"row": i}})
    return samples


def lora_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


class ToyWithDeadHead(ToyDiT):
    """Like Qwen-Image's last block: a layer whose output nobody reads (it can never learn)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 16)

    def forward(self, latents, sigmas, prompt_embeds, prompt_mask=None):
        self.head(self.inp(latents.flatten(2).transpose(1, 2)))  # computed, never used
        return super().forward(latents, sigmas, prompt_embeds, prompt_mask)


def tiny_family_dit(family: str, dtype: torch.dtype, n_samples: int = 2):
    """(spec, a real diffusers DiT of ``family`` at its tiny widths and two blocks with random
    weights in ``dtype``, ``n_samples`` 64x64 samples with 16 text tokens)."""
    import importlib

    from diffsynth_core.models import get_family
    from diffsynth_core.models.random_models import build_random_transformer

    spec, module = get_family(family), importlib.import_module(f"diffsynth_core.models.{family}")
    cfg = {**module.TRANSFORMER_CONFIGS["tiny"], "num_layers": 2}
    model = build_random_transformer(module.TRANSFORMER_CLASS, {"w": cfg}, "w", dtype, torch.device("cpu"))
    samples = []
    for seed in range(n_samples):
        latents, cond = spec.dummy_inputs(model.config, batch=1, height=64, width=64, text_len=16, seed=seed)
        samples.append({"latents": latents[0], **{k: v[0] for k, v in cond.items()}})
    return spec, model, samples
