"""FLUX.2's VAE as one file in BFL's names (``ae.safetensors``) or ComfyUI's (``flux2-vae.safetensors``, quant
convs at the top, maybe under ``first_stage_model.`` / ``vae.``): the fixtures' names are checked against names
copied from the reference sources (not against our own map alone); such a file is recognised from its weights,
loads bit for bit and encodes as the original; a missing or misshapen tensor is one line naming file and key;
``model.sources.vae`` takes the file through stage 1's own loader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family, known_families, released
from diffsynth_core.models.flux2 import tiny_vae
from diffsynth_core.models.flux2_vae_released import bfl_vae_to_diffusers

from .released_layouts import bfl_vae_names, plain_config

FORMATS = {name: get_family(name).released_formats for name in known_families()}
KLEIN = "klein-base-4b"

# Names and shapes as black-forest-labs/flux2 src/flux2/autoencoder.py builds them (Encoder.down[i].block[j],
# .downsample on every level but the last, mid.block_1 / attn_1 (q, k, v, proj_out: Conv2d 1x1) / block_2,
# norm_out, Encoder.quant_conv; Decoder.up[i] prepended so up.0 is the highest resolution, num_res_blocks + 1
# blocks, .upsample on every level but 0, Decoder.post_quant_conv; AutoEncoder.bn over 2x2 * z_channels) for
# ch=32, ch_mult=[1, 2], num_res_blocks=1, z_channels=8.
BFL_NAMES = {
    "encoder.down.1.block.0.norm1.weight": (32,), "encoder.down.1.block.0.conv1.weight": (64, 32, 3, 3),
    "encoder.down.1.block.0.norm2.bias": (64,), "encoder.down.1.block.0.conv2.weight": (64, 64, 3, 3),
    "encoder.down.1.block.0.nin_shortcut.weight": (64, 32, 1, 1), "encoder.down.1.block.0.nin_shortcut.bias": (64,),
    "encoder.down.0.downsample.conv.weight": (32, 32, 3, 3), "encoder.down.0.downsample.conv.bias": (32,),
    "encoder.mid.block_1.conv1.weight": (64, 64, 3, 3), "encoder.mid.block_2.norm2.weight": (64,),
    "encoder.mid.attn_1.norm.weight": (64,), "encoder.mid.attn_1.q.weight": (64, 64, 1, 1),
    "encoder.mid.attn_1.k.bias": (64,), "encoder.mid.attn_1.v.weight": (64, 64, 1, 1),
    "encoder.mid.attn_1.proj_out.weight": (64, 64, 1, 1), "encoder.norm_out.weight": (64,),
    "encoder.conv_out.weight": (16, 64, 3, 3), "encoder.quant_conv.weight": (16, 16, 1, 1),
    "decoder.post_quant_conv.weight": (8, 8, 1, 1), "decoder.conv_in.weight": (64, 8, 3, 3),
    "decoder.up.1.block.1.conv2.weight": (64, 64, 3, 3), "decoder.up.1.upsample.conv.weight": (64, 64, 3, 3),
    "decoder.up.0.block.0.nin_shortcut.weight": (32, 64, 1, 1), "decoder.up.0.block.1.conv1.weight": (32, 32, 3, 3),
    "decoder.mid.attn_1.proj_out.bias": (64,), "decoder.norm_out.bias": (32,),
    "bn.running_mean": (32,), "bn.running_var": (32,),
}
NOT_BFL_NAMES = ("encoder.down.1.downsample.conv.weight", "decoder.up.0.upsample.conv.weight", "quant_conv.weight",
                 "post_quant_conv.weight", "encoder.down.0.block.0.nin_shortcut.weight")
# ComfyUI (Comfy-Org/ComfyUI comfy/sd.py, VAE.__init__: "decoder.post_quant_conv." -> "post_quant_conv.",
# "encoder.quant_conv." -> "quant_conv."; comfy/ldm/models/autoencoder.py holds them and bn at the top).
COMFY_NAMES = {"quant_conv.weight": (16, 16, 1, 1), "post_quant_conv.weight": (8, 8, 1, 1), "bn.running_var": (32,)}


def _two_level_vae():
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    return AutoencoderKLFlux2(block_out_channels=[32, 64], latent_channels=8, layers_per_block=1,
                              down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)


def test_the_fixture_names_are_the_reference_sources_names():
    """Our inverse map (which writes the fixtures below) against names copied from BFL's and ComfyUI's code;
    the forward map brings every tensor back unchanged."""
    state = _two_level_vae().state_dict()
    bfl, comfy = bfl_vae_names(state), bfl_vae_names(state, comfy=True)
    assert {k: tuple(bfl[k].shape) for k in BFL_NAMES} == BFL_NAMES
    assert not set(NOT_BFL_NAMES) & set(bfl)
    assert {k: tuple(comfy[k].shape) for k in COMFY_NAMES} == COMFY_NAMES
    assert set(comfy) - set(bfl) == {k for k in COMFY_NAMES if k.endswith("quant_conv.weight")} | \
        {"quant_conv.bias", "post_quant_conv.bias"}
    for names in (bfl, comfy):
        back = bfl_vae_to_diffusers(names)
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def _file(tmp_path, state, comfy=False, prefix="", counter=True):
    names = bfl_vae_names(state, comfy=comfy)
    if not counter:
        del names["bn.num_batches_tracked"]
    path = tmp_path / "weights.safetensors"  # no release name: the weights alone tell
    save_file({prefix + k: v for k, v in names.items()}, str(path))
    return path


@pytest.mark.parametrize("comfy, prefix, counter", [(False, "", False), (False, "", True),
                                                    (True, "first_stage_model.", True), (True, "vae.", False)])
def test_a_released_vae_file_is_recognised_and_loads_and_encodes_as_the_original(tmp_path, comfy, prefix, counter):
    vae = tiny_vae().eval()
    path = _file(tmp_path, vae.state_dict(), comfy, prefix, counter)
    found = released.recognise(FORMATS, [path])
    assert [(family, fmt.component, fmt.convert is not None) for family, fmt in found] == [("flux2", "vae", True)]
    loaded = released.load_named(get_family("flux2").released_formats, "vae", [path], torch.float32)
    ours, theirs = loaded.state_dict(), vae.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert plain_config(loaded.config) == plain_config(vae.config)
    pixels = torch.rand(3, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    spec = get_family("flux2", KLEIN)
    assert torch.equal(spec.encode_pixels({"vae": loaded}, pixels, "cpu")["latents"],
                       spec.encode_pixels({"vae": vae}, pixels, "cpu")["latents"])


@pytest.mark.parametrize("file_key, shape, named, says", [
    ("encoder.down.0.block.0.norm1.bias", None, "encoder.down_blocks.0.resnets.0.norm1.bias", "1 missing"),
    ("encoder.mid.attn_1.q.weight", (32, 16, 1, 1), "encoder.mid_block.attentions.0.to_q.weight", "1 misshapen"),
    ("decoder.up.0.block.0.conv2.weight", None, "decoder.up_blocks.3.resnets.0.conv2.weight",  # the config reads it
     "cannot derive the AutoencoderKLFlux2 config"),
])
def test_a_missing_or_misshapen_tensor_is_one_line_naming_file_and_key(tmp_path, file_key, shape, named, says):
    """The key is named as the model names it (the file's name in the parameters here)."""
    names = bfl_vae_names(tiny_vae().state_dict())
    if shape is None:
        del names[file_key]
    else:
        names[file_key] = torch.zeros(shape)
    path = tmp_path / "ae.safetensors"
    save_file(names, str(path))
    with pytest.raises(InputError) as error:
        released.load_named(get_family("flux2").released_formats, "vae", [path], torch.float32)
    message = str(error.value)
    assert str(path) in message and named in message and says in message and "\n" not in message
    assert error.value.exit_code == 2


@pytest.mark.parametrize("file_key", ["bn.running_mean", "encoder.conv_out.weight"])
def test_a_file_lacking_what_tells_flux2_apart_is_still_taken_and_the_key_named(tmp_path, file_key):
    """The batch norm and ``encoder.conv_out`` tell FLUX.2's VAE from FLUX.1's (same BFL names): a file
    lacking either is taken by the other (the release's 32 latent channels, or the batch norm), so the one
    line names the missing key instead of saying no family knows the file."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(block_out_channels=[32, 32], latent_channels=32, layers_per_block=1,
                             down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
    names = bfl_vae_names(vae.state_dict())
    del names[file_key]
    path = tmp_path / "ae.safetensors"
    save_file(names, str(path))
    with pytest.raises(InputError) as error:
        released.load_named(get_family("flux2").released_formats, "vae", [path], torch.float32)
    message = str(error.value)
    assert str(path) in message and file_key in message and "\n" not in message
    assert error.value.exit_code == 2


def test_model_sources_vae_takes_the_file_through_stage_one(released_models, tmp_path):
    """Stage 1's loader with the text encoder from the klein folder and the VAE from BFL's single file: the
    latents are the folder VAE's."""
    from safetensors.torch import load_file

    from stages.config import build_config
    from stages.encoding import load_encoders

    folder = released_models("flux2") / "reference"
    path = _file(tmp_path, load_file(str(folder / "vae" / "diffusion_pytorch_model.safetensors")))
    cfg = build_config({"dataset": {"base_path": str(tmp_path), "metadata_path": str(tmp_path / "m.csv")},
                        "model": {"family": "flux2", "variant": KLEIN, "path": str(folder), "dtype": "float32",
                                  "sources": {"vae": [str(path)]}},
                        "cache": {"url": str(tmp_path / "c.zarr")}, "output": {"path": str(tmp_path / "out")}},
                       [], source="test")
    spec = get_family("flux2", KLEIN)
    ours = load_encoders(cfg, spec, torch.device("cpu")).components
    theirs = spec.load_encoders(folder, torch.float32)
    pixels = torch.rand(3, 1, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    assert torch.equal(spec.encode_pixels(ours, pixels, "cpu")["latents"],
                       spec.encode_pixels(theirs, pixels, "cpu")["latents"])
