"""Loading only what stage 1 reads, shared by the families.

Prompt encoding needs the text tower and the tokenizer; pixel encoding needs the VAE's encoder.
A vision-language model's vision tower and language-model head, and a VAE's decoder, are never
used there: not loading them saves their host RAM, their transfer and their GPU memory
(Qwen2.5-VL-7B: 1.1 GB of LM head and 1.3 GB of vision tower).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .loading import MODEL_INIT_LOCK, check_materialised, named_load_errors

# checkpoint key -> name in the sub-model, or None for a tensor the sub-model does not hold
Rename = Callable[[str], "str | None"]


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a transformers/diffusers component folder (sharded or single)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    return files


def load_submodel(folder: Path, model_cls: type, config, dtype: torch.dtype, rename: Rename) -> nn.Module:
    """``model_cls`` built from ``config`` and filled from the folder's safetensors in ``dtype``.

    Only the tensors ``rename`` maps to one of the sub-model's weights are read; the others
    never leave the disk.  Every weight of the sub-model must be found (no silent random init).
    A truncated, missing or foreign weight file is one line naming the folder and file.
    """
    with named_load_errors(Path(folder)):
        return _load_submodel(Path(folder), model_cls, config, dtype, rename)


def _load_submodel(folder: Path, model_cls: type, config, dtype: torch.dtype, rename: Rename) -> nn.Module:
    from accelerate import init_empty_weights

    with MODEL_INIT_LOCK, init_empty_weights():  # weights on meta; buffers (RoPE tables) real
        model = model_cls._from_config(config, dtype=dtype)
    wanted = {name: p.dtype for name, p in model.named_parameters()}
    wanted.update({name: b.dtype for name, b in model.named_buffers() if b.device.type == "meta"})
    state: dict[str, torch.Tensor] = {}
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                name = rename(key)
                if name in wanted and name not in state:
                    state[name] = handle.get_tensor(key).to(wanted[name])
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ValueError(f"{folder}: {len(missing)} weight(s) of {model_cls.__name__} not found "
                         f"(e.g. {missing[:3]}); is this the right model folder?")
    model.load_state_dict(state, strict=False, assign=True)
    check_materialised(model, folder)
    return model.eval()


def without_decoder(vae: nn.Module) -> nn.Module:
    """The VAE with its decoder dropped (encoding never runs it).

    An empty module stands in for the decoder because some VAEs count its layers when they
    reset their causal-conv caches (AutoencoderKLQwenImage.clear_cache).
    """
    vae.decoder = nn.Module()
    if getattr(vae, "post_quant_conv", None) is not None:
        vae.post_quant_conv = None
    return vae


def drop_layers_after(text_encoder: nn.Module, last_read: int) -> nn.Module:
    """Drop a transformers decoder's layers that no hidden state ``<= last_read`` depends on.

    ``hidden_states[k]`` is layer ``k``'s input (the last one is the final norm's output instead), so
    ``last_read + 1`` layers leave ``hidden_states[0..last_read]`` as the whole model computes them: FLUX.2-dev
    reads layers 10, 20 and 30 of Mistral's 40, and the other 9 would cost a quarter of stage 1's streamed
    bytes and compute.  The decoder is the module with token embeddings whose ``layers`` its config counts
    (not a vision tower's)."""
    for module in text_encoder.modules():
        layers, config = getattr(module, "layers", None), getattr(module, "config", None)
        if isinstance(layers, nn.ModuleList) and hasattr(module, "embed_tokens") and \
                getattr(config, "num_hidden_layers", None) == len(layers):
            keep = min(len(layers), last_read + 1)
            module.layers = layers[:keep]
            config.num_hidden_layers = keep
            if isinstance(getattr(config, "layer_types", None), list):
                config.layer_types = config.layer_types[:keep]
            return text_encoder
    raise ValueError(f"{type(text_encoder).__name__}: no decoder layers to keep {last_read + 1} of")


def enable_vae_tiling(vae: nn.Module, tile: int) -> None:
    """Encode in ``tile`` x ``tile`` pixel tiles overlapping by a quarter (diffusers' tiled encode).

    Handles both diffusers tiling APIs: AutoencoderKL (one square size) and the Wan-style VAEs
    (height and width with strides).  Changes the latents: callers put the tile into cache keys.
    """
    if hasattr(vae, "tile_sample_min_height"):  # AutoencoderKLWan / AutoencoderKLQwenImage
        stride = tile * 3 // 4
        vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                          tile_sample_stride_height=stride, tile_sample_stride_width=stride)
        return
    vae.enable_tiling()  # AutoencoderKL: overlap factor 0.25 of its own
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // scale


def disable_vae_tiling(vae: nn.Module) -> None:
    vae.disable_tiling()
