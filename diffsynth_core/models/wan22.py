"""Wan2.2 as data: the layouts its variants of the ``wan`` family differ in, and how a folder or a DiT file tells them.

* **TI2V-5B**: a 48-channel DiT (24 heads of 128, 30 blocks) over the Wan2.2 VAE (16x spatial,
  4x temporal, 48 channels: its encoder takes 2x2 pixel patches, 12 channels in), with one timestep
  per latent token (diffusers' ``WanPipeline(expand_timesteps=True)``).
* **T2V-A14B / I2V-A14B**: two Wan2.1-14B-shaped DiTs over the Wan2.1 VAE, ``transformer`` for the
  high-noise steps (``t >= boundary_ratio * 1000``) and ``transformer_2`` below
  (``WanPipeline(boundary_ratio=...)``).

The VAE's latent statistics are the release's (DiffSynth-Studio diffsynth/models/wan_video_vae.py,
``WanVideoVAE38``; the same 48 values diffusers' Wan2.2 VAE config carries).
"""

from __future__ import annotations

import re
from pathlib import Path

from .loading import read_model_index_file
from .weight_files import is_weight_file, read_shapes


# Wan2.2 VAE normalisation (z - mean) / std, per latent channel.
LATENTS_MEAN_48 = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
LATENTS_STD_48 = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]

# AutoencoderKLWan at the Wan2.2 layout (the release: base 160 / decoder 256, 2 res blocks) and a
# tiny one of the same architecture (residual blocks, 2x2 patchified input) for tests.
VAE22 = dict(z_dim=48, dim_mult=[1, 2, 4, 4], temperal_downsample=[False, True, True], is_residual=True,
             in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
             latents_mean=LATENTS_MEAN_48, latents_std=LATENTS_STD_48)
VAE22_RELEASED = dict(VAE22, base_dim=160, decoder_base_dim=256, num_res_blocks=2)
VAE22_TINY = dict(VAE22, base_dim=8, decoder_base_dim=8, num_res_blocks=1)

# The A14B experts switch at t = boundary_ratio * 1000 (the releases' model_index.json).
BOUNDARY_RATIO = {"t2v-a14b": 0.875, "i2v-a14b": 0.900}

# Which variant a diffusers folder is, from its model_index.json: (pipeline, two experts, per-token t, a CLIP tower).
_VARIANT_OF_INDEX = {
    ("WanPipeline", False, False, False): "t2v",
    ("WanPipeline", False, True, False): "ti2v-5b",
    ("WanPipeline", True, False, False): "t2v-a14b",
    ("WanImageToVideoPipeline", False, False, True): "i2v",
    ("WanImageToVideoPipeline", False, False, False): "i2v-a14b-expert",
    ("WanImageToVideoPipeline", False, True, False): "ti2v-5b",
    ("WanImageToVideoPipeline", True, False, False): "i2v-a14b",
}
# Which variant a DiT file is, from its shapes: (input channels, a CLIP image embedder), as DiffSynth-Studio's
# configs/model_configs.py tells its files apart (``in_dim``, ``has_image_input``).  One expert of an A14B
# release is a single DiT: a T2V expert is Wan2.1 T2V's layout, an I2V expert has no image embedder.
_VARIANT_OF_DIT = {(16, False): "t2v", (48, False): "ti2v-5b", (36, True): "i2v", (36, False): "i2v-a14b-expert"}
_IMAGE_EMBEDDER = ("img_emb.proj.0.weight", "condition_embedder.image_embedder.norm1.weight")
_SHARD = re.compile(r"^(?P<stem>.+)-\d{5}-of-(?P<total>\d{5})\.safetensors$")


def variant_of(path: Path | None) -> str | None:
    """The ``wan`` variant a diffusers folder holds (its ``model_index.json``) or a DiT file is (its shapes); a
    place without either (no folder, or files not there yet) is Wan2.1 T2V, the family's base layout."""
    path = Path(path) if path else None
    if path is not None and path.is_file() and is_weight_file(path):
        return _variant_of_dit(read_shapes(_shard_group(path)))
    index = path / "model_index.json" if path else None
    if index is None or not index.is_file():
        return "t2v"
    raw = read_model_index_file(Path(path))  # unreadable: one line naming the file
    if raw.get("_class_name") not in {key[0] for key in _VARIANT_OF_INDEX}:
        return "t2v"  # another family's folder: loading it names the mismatch (check_model_folder)
    experts = raw.get("transformer_2", [None])[0] is not None and raw.get("boundary_ratio") is not None
    clip = raw.get("image_encoder", [None])[0] is not None
    return _VARIANT_OF_INDEX.get((raw.get("_class_name"), experts, bool(raw.get("expand_timesteps")), clip))


def _shard_group(path: Path) -> list[Path]:
    """A DiT shard with its siblings (``stem-0000N-of-0000M.safetensors``): the input layer and the image
    embedder may lie in different shards."""
    match = _SHARD.match(path.name)
    if match is None:
        return [path]
    return sorted(path.parent.glob(f"{match['stem']}-*-of-{match['total']}.safetensors"))


def _variant_of_dit(shapes) -> str | None:
    """None: not a whole Wan DiT (another component's file, a shard set missing its input layer) or a layout
    no variant has (Fun-Control's 52 channels, ...): the caller asks for ``model.variant``."""
    if "patch_embedding.weight" not in shapes:
        return None
    image = any(name in shapes for name in _IMAGE_EMBEDDER)
    return _VARIANT_OF_DIT.get((shapes["patch_embedding.weight"][1], image))
