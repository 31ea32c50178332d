"""FLUX.2's VAE as released: diffusers names (``vae/``) and one file in BFL's or ComfyUI's names.

* ``vae/diffusion_pytorch_model.safetensors`` of the diffusers releases: ``AutoencoderKLFlux2``'s own names.
* BFL's ``ae.safetensors`` (black-forest-labs FLUX.2 repos) and Comfy-Org's ``flux2-vae.safetensors``: the
  names of black-forest-labs/flux2 ``src/flux2/autoencoder.py`` (``encoder.down.N.block.M``, the mid block's
  ``attn_1.q/k/v/proj_out`` as 1x1 convs, ``encoder.quant_conv``, ``decoder.up.N`` counted from the highest
  resolution, ``decoder.post_quant_conv``, the latent batch norm ``bn.running_mean`` / ``bn.running_var``).
* ComfyUI's module names (Comfy-Org/ComfyUI ``comfy/ldm/models/autoencoder.py`` ``AutoencoderKL``, which
  ``comfy/sd.py`` renames BFL's file into; what ComfyUI saves): the same but ``quant_conv`` /
  ``post_quant_conv`` at the top; in a ComfyUI checkpoint under ``first_stage_model.``, in some merges
  under ``vae.`` (a file whose keys all carry one of these prefixes).

The name map is diffusers' ``scripts/convert_flux2_to_diffusers.py`` (``convert_flux2_vae_checkpoint_to_diffusers``,
LDM-style renames plus ``DIFFUSERS_VAE_TO_FLUX2_MAPPING``), written as one function of a key.  Every key the
file has is converted, the decoder's too (the whole ``AutoencoderKLFlux2`` is built; stage 1 never runs its
decoder); a key the map does not know passes through unchanged, so the load reports it rather than dropping it.
``bn.num_batches_tracked`` (absent from some files) is only the training counter of the batch norm: a file
without it gets 0, as ``BatchNorm2d`` itself fills it for checkpoints that lack it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .released import ReleasedFormat, count_indices
from .weight_files import Shapes, StateDict

RELEASED_LATENT_CHANNELS = 32  # black-forest-labs/FLUX.2-dev vae/config.json (FLUX.1's VAE: 16)

# The release's facts that are not in the weights' shapes (black-forest-labs/FLUX.2-dev vae/config.json;
# BFL's autoencoder.py: bn_eps 1e-4, bn_momentum 0.1, GroupNorm(32)).
VAE_FACTS = dict(act_fn="silu", norm_num_groups=32, sample_size=1024, batch_norm_eps=1e-4, batch_norm_momentum=0.1,
                 in_channels=3, out_channels=3)


# --- diffusers names ---------------------------------------------------------------------------------

def _is_flux2_vae(s: Shapes) -> bool:
    return "bn.running_mean" in s and "encoder.down_blocks.0.resnets.0.conv1.weight" in s


def vae_config(s: Shapes) -> dict[str, Any]:
    """``AutoencoderKLFlux2``'s config from its (diffusers-named) weights' shapes."""
    levels = count_indices(s, "encoder.down_blocks.")
    encoder = [s[f"encoder.down_blocks.{i}.resnets.0.conv2.weight"][0] for i in range(levels)]
    decoder = [s[f"decoder.up_blocks.{levels - 1 - i}.resnets.0.conv2.weight"][0] for i in range(levels)]
    latent = s["encoder.conv_out.weight"][0] // 2
    patch = int(round((s["bn.running_mean"][0] // latent) ** 0.5))
    return dict(VAE_FACTS, down_block_types=["DownEncoderBlock2D"] * levels,
                up_block_types=["UpDecoderBlock2D"] * levels,
                block_out_channels=encoder, decoder_block_out_channels=None if decoder == encoder else decoder,
                layers_per_block=count_indices(s, "encoder.down_blocks.0.resnets."), latent_channels=latent,
                use_quant_conv="quant_conv.weight" in s, use_post_quant_conv="post_quant_conv.weight" in s,
                mid_block_add_attention="encoder.mid_block.attentions.0.to_q.weight" in s, patch_size=[patch, patch])


# --- BFL / ComfyUI names -> diffusers names --------------------------------------------------------

PREFIXES = ("first_stage_model.", "vae.")  # ComfyUI checkpoints; some merged files
_ROOT = {"encoder.quant_conv": "quant_conv", "quant_conv": "quant_conv",
         "decoder.post_quant_conv": "post_quant_conv", "post_quant_conv": "post_quant_conv",
         "encoder.norm_out": "encoder.conv_norm_out", "decoder.norm_out": "decoder.conv_norm_out"}
RESNET_NAMES = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2",
                "nin_shortcut": "conv_shortcut"}
ATTENTION_NAMES = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_MID = re.compile(r"^(encoder|decoder)\.mid\.(?:block_([12])\.(\w+)|attn_1\.(\w+))$")
_LEVEL = re.compile(r"^(encoder\.down|decoder\.up)\.(\d+)\.(?:block\.(\d+)\.(\w+)|(downsample|upsample)\.conv)$")
ATTENTION_WEIGHT = re.compile(r"^(encoder|decoder)\.mid_block\.attentions\.0\.to_(q|k|v|out\.0)\.weight$")
BN_COUNTER = "bn.num_batches_tracked"


def _diffusers_module(module: str, up_levels: int) -> str | None:
    """The diffusers module of a BFL / ComfyUI module (None: not one the map knows)."""
    if module in _ROOT:
        return _ROOT[module]
    match = _MID.match(module)
    if match:
        side, block, part, attention = match.groups()
        if block is not None:
            resnet = RESNET_NAMES.get(part)
            return resnet and f"{side}.mid_block.resnets.{int(block) - 1}.{resnet}"
        target = ATTENTION_NAMES.get(attention)
        return target and f"{side}.mid_block.attentions.0.{target}"
    match = _LEVEL.match(module)
    if match is None:
        return None
    where, level, block, part, sampler = match.groups()
    if where == "encoder.down":
        prefix = f"encoder.down_blocks.{level}"
    else:  # BFL prepends each decoder level: up.0 is the highest resolution, diffusers' last up block
        prefix = f"decoder.up_blocks.{up_levels - 1 - int(level)}"
    if sampler is not None:
        return f"{prefix}.{sampler}rs.0.conv"
    return f"{prefix}.resnets.{block}.{RESNET_NAMES[part]}" if part in RESNET_NAMES else None


def diffusers_name(key: str, up_levels: int) -> str:
    """The ``AutoencoderKLFlux2`` name of an (unprefixed) BFL / ComfyUI key; an unknown key is returned as is."""
    if key.startswith("bn."):
        return key
    module, _, param = key.rpartition(".")
    target = _diffusers_module(module, up_levels)
    return key if target is None else f"{target}.{param}"


def _prefix(keys) -> str | None:
    """The prefix every key carries ("" or ``PREFIXES``) in a file of BFL / ComfyUI VAE names."""
    keys = list(keys)
    for prefix in ("",) + PREFIXES:
        if all(k.startswith(prefix) for k in keys) and prefix + "encoder.down.0.block.0.conv1.weight" in keys:
            return prefix
    return None


def _renamed(items: dict, flatten) -> dict:
    """``items`` (BFL / ComfyUI key -> tensor or shape) under diffusers names; 1x1-conv attention weights
    flattened to the Linear's two dimensions by ``flatten``; the batch-norm counter filled in when absent."""
    prefix = _prefix(items) or ""
    items = {k[len(prefix):]: v for k, v in items.items()}
    up_levels = count_indices(items, "decoder.up.")
    out = {}
    for key, value in items.items():
        name = diffusers_name(key, up_levels)
        out[name] = flatten(value) if ATTENTION_WEIGHT.match(name) else value
    return out


def _flatten_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:2] if len(shape) == 4 and shape[2:] == (1, 1) else shape


def _flatten_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1) if t.ndim == 4 and t.shape[2:] == (1, 1) else t


def bfl_vae_to_diffusers(state: StateDict) -> StateDict:
    """BFL's ``ae.safetensors`` / ComfyUI's names (a ``first_stage_model.`` / ``vae.`` prefix dropped) ->
    ``AutoencoderKLFlux2`` names."""
    out = _renamed(state, _flatten_tensor)
    if "bn.running_mean" in out and BN_COUNTER not in out:
        out[BN_COUNTER] = torch.tensor(0, dtype=torch.long)
    return out


def _diffusers_shapes(s: Shapes) -> Shapes:
    out = _renamed(s, _flatten_shape)
    if "bn.running_mean" in out:
        out.setdefault(BN_COUNTER, ())
    return out


def _is_bfl_vae(s: Shapes) -> bool:
    """BFL / ComfyUI names, and the shapes of a 2x2-patchified latent batch norm: ``bn`` holds p*p times the
    latent channels (half of ``encoder.conv_out``'s outputs: mean and log-variance).  A file lacking one of
    the two is still taken when the other says FLUX.2 (its batch norm, or the release's 32 latent channels
    where FLUX.1's ``ae.safetensors`` has 16), so the load names the missing key rather than not knowing
    the file."""
    prefix = _prefix(s)
    if prefix is None:
        return False
    moments, features = s.get(prefix + "encoder.conv_out.weight", (0,))[0], s.get(prefix + "bn.running_mean")
    if features is None or moments == 0:
        return features is not None or moments == 2 * RELEASED_LATENT_CHANNELS
    if moments < 2 or moments % 2 or len(features) != 1 or features[0] % (moments // 2):
        return False
    patch = round((features[0] // (moments // 2)) ** 0.5)
    return patch * patch * (moments // 2) == features[0]


def _bfl_vae_config(s: Shapes) -> dict[str, Any]:
    return vae_config(_diffusers_shapes(s))


FORMATS = (
    ReleasedFormat("vae", "diffusers", "AutoencoderKLFlux2", "FLUX.2 vae weights (diffusers names)", _is_flux2_vae,
                   vae_config),
    ReleasedFormat("vae", "diffusers", "AutoencoderKLFlux2",
                   "FLUX.2 VAE single file (BFL ae.safetensors / ComfyUI flux2-vae.safetensors names)",
                   _is_bfl_vae, _bfl_vae_config, convert=bfl_vae_to_diffusers),
)
