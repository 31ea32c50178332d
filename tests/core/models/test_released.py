"""Released layouts (BFL FLUX, Wan's originals, Qwen-Image subfolders without config.json) load the
same model as the diffusers layout; converters agree with diffusers' own; configs inferred from the
shapes reproduce the released configs; pickled weights never run code."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family, known_families, released
from diffsynth_core.models.flux_released import bfl_to_diffusers, diffusers_to_bfl
from diffsynth_core.models.loading import load_component as load_reference
from diffsynth_core.models.weight_files import load_file as load_weights

from .released_layouts import MODEL_IDS, ldm_vae_names, wan_transformer_names, wan_vae_names

# Component -> files, as DiffSynth's example scripts name them (examples/*/model_training/lora/*.sh).
SCRIPT_FILES = {
    "qwen_image": {"transformer": "transformer/diffusion_pytorch_model*.safetensors",
                   "text_encoder": "text_encoder/model*.safetensors", "vae": "vae/diffusion_pytorch_model.safetensors"},
    "flux": {"transformer": "flux1-dev.safetensors", "text_encoder": "text_encoder/model.safetensors",
             "text_encoder_2": "text_encoder_2/*.safetensors", "vae": "ae.safetensors"},
    "wan": {"transformer": "diffusion_pytorch_model*.safetensors", "text_encoder": "models_t5_umt5-xxl-enc-bf16.pth",
            "vae": "Wan2.1_VAE.pth"},
}
FORMATS = {name: get_family(name).released_formats for name in known_families()}


def _files(root, family, component):
    return sorted((root / "models" / MODEL_IDS[family]).glob(SCRIPT_FILES[family][component]))


def _plain(config) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items() if not k.startswith("_")}


@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
def test_released_files_load_the_reference_model(family, released_models):
    root = released_models(family)
    for component in SCRIPT_FILES[family]:
        files = _files(root, family, component)
        assert [f for f, fmt in released.recognise(FORMATS, files) if fmt.component == component] , component
        model = released.load_named(get_family(family).released_formats, component, files, torch.float32)
        reference = load_reference(root / "reference", component, torch.float32)
        ours, theirs = model.state_dict(), reference.state_dict()
        assert ours.keys() == theirs.keys(), component
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), component
        if isinstance(model, torch.nn.Module) and hasattr(model.config, "to_dict"):  # transformers: same outputs
            ids = torch.tensor([[3, 7, 11, 5, 1]])
            torch.testing.assert_close(model(input_ids=ids)[0], reference(input_ids=ids)[0], rtol=0, atol=0)
        else:
            diffusers_config = _plain(reference.config)
            assert {k: v for k, v in _plain(model.config).items() if v is not None} == \
                   {k: v for k, v in diffusers_config.items() if v is not None and k in _plain(model.config)}


# Wan releases beyond Wan2.1 T2V (wan_released_layouts.py): component -> (files, the reference folder's component)
WAN_RELEASE_FILES = {
    "wan-ti2v-5b": {"transformer": ("diffusion_pytorch_model*.safetensors", "transformer"),
                    "vae": ("Wan2.2_VAE.pth", "vae")},
    "wan-i2v-a14b": {"transformer": ("high_noise_model/*.safetensors", "transformer"),
                     "transformer_2": ("low_noise_model/*.safetensors", "transformer_2")},
    "wan-i2v-14b": {"transformer": ("diffusion_pytorch_model*.safetensors", "transformer"),
                    "image_encoder": ("models_clip_*.pth", "image_encoder")},
}


@pytest.mark.parametrize("release", WAN_RELEASE_FILES)
def test_wan_releases_load_the_reference_model_and_tell_their_variant(release, released_models):
    """The Wan2.2 VAE (Wan's nested names), Wan2.1 I2V's DiT and CLIP (open-clip's names) load the diffusers
    reference; each DiT's files tell its variant, shards read together."""
    from diffsynth_core.models.wan22 import variant_of

    from .wan_released_layouts import MODEL_IDS as WAN_IDS

    root = released_models(release)
    variants = {"wan-ti2v-5b": "ti2v-5b", "wan-i2v-a14b": "i2v-a14b-expert", "wan-i2v-14b": "i2v"}
    for component, (pattern, reference_name) in WAN_RELEASE_FILES[release].items():
        files = sorted((root / "models" / WAN_IDS[release]).glob(pattern))
        assert component in {fmt.component for _, fmt in released.recognise(FORMATS, files)}
        model = released.load_named(FORMATS["wan"], component, files, torch.float32)
        reference = load_reference(root / "reference", reference_name, torch.float32)
        ours, theirs = model.state_dict(), reference.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), component
        if component.startswith("transformer"):
            assert {variant_of(f) for f in files} == {variants[release]}
    if release == "wan-ti2v-5b":  # the diffusers-named Wan2.2 VAE without its config.json: config from the shapes
        weights = [root / "reference" / "vae" / "diffusion_pytorch_model.safetensors"]
        assert {(family, fmt.component) for family, fmt in released.recognise(FORMATS, weights)} == {("wan", "vae")}
        vae = released.load_named(FORMATS["wan"], "vae", weights, torch.float32)
        expected = load_reference(root / "reference", "vae", torch.float32)
        assert _plain(vae.config) == _plain(expected.config)
        assert all(torch.equal(v, expected.state_dict()[k]) for k, v in vae.state_dict().items())


def test_bfl_table_agrees_with_diffusers_converter_at_flux1_width():
    """diffusers' converter hard-codes FLUX.1's width; compare at that width with 1-column tensors."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    model = get_family("flux").build_transformer("FLUX.1-dev", torch.float32, "meta")
    keep = ("transformer_blocks.0.", "single_transformer_blocks.0.")
    shapes = {k: v.shape for k, v in model.state_dict().items()
              if not k.split(".")[0].endswith("blocks") or k.startswith(keep)}
    g = torch.Generator().manual_seed(0)
    ours = {k: torch.randn((s[0], 1) if len(s) == 2 else (s[0],), generator=g) for k, s in shapes.items()}
    bfl = diffusers_to_bfl(ours)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    back = bfl_to_diffusers(bfl)
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_fixture_inverses_agree_with_diffusers_converters(released_models):
    from diffusers.loaders.single_file_utils import (convert_ldm_vae_checkpoint, convert_wan_transformer_to_diffusers,
                                                     convert_wan_vae_to_diffusers)

    from diffsynth_core.models.flux_released import _ldm_vae_config

    flux_vae = load_file(str(released_models("flux") / "reference/vae/diffusion_pytorch_model.safetensors"))
    ldm = ldm_vae_names(flux_vae)
    back = convert_ldm_vae_checkpoint(dict(ldm), _ldm_vae_config({k: tuple(v.shape) for k, v in ldm.items()}))
    assert back.keys() == flux_vae.keys() and all(torch.equal(back[k], flux_vae[k]) for k in back)

    wan = released_models("wan") / "reference"
    for name, inverse, convert in (("vae", wan_vae_names, convert_wan_vae_to_diffusers),
                                   ("transformer", wan_transformer_names, convert_wan_transformer_to_diffusers)):
        state = load_file(str(wan / name / "diffusion_pytorch_model.safetensors"))
        native = inverse(state)
        assert not any(part in k for k in native for part in ("down_blocks", "up_blocks", "mid_block", "attn1", ".to_q."))
        back = convert(dict(native))
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in back), name


@pytest.mark.parametrize("family,variant", [("qwen_image", "Qwen-Image"), ("flux", "FLUX.1-dev"),
                                            ("wan", "Wan2.1-T2V-14B")])
def test_configs_inferred_from_released_shapes_are_the_released_configs(family, variant):
    spec = get_family(family)
    model = spec.build_transformer(variant, torch.bfloat16, "meta")
    state = model.state_dict()
    if family == "flux":
        state = diffusers_to_bfl(state)
    if family == "wan":
        state = wan_transformer_names(state)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    fmt = next(f for f in spec.released_formats if f.component == "transformer" and f.recognise(shapes))
    from accelerate import init_empty_weights

    with init_empty_weights():  # a config check: never allocate a 20 B-parameter model
        inferred = _plain(type(model).from_config(fmt.infer_config(shapes)).config)
    assert inferred == _plain(model.config)


def test_text_encoder_configs_inferred_for_the_released_sizes():
    """Qwen2.5-VL-7B (DiffSynth's qwen_image_text_encoder.py) and T5-XXL / UMT5-XXL, built on meta."""
    from accelerate import init_empty_weights
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, UMT5Config, UMT5EncoderModel

    from diffsynth_core.models.qwen_image_released import _text_config
    from diffsynth_core.models.released import t5_encoder_config

    with init_empty_weights():
        qwen = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                             num_key_value_heads=4, vocab_size=152064),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
            vocab_size=152064))
        umt5 = UMT5EncoderModel(UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                           num_heads=64, feed_forward_proj="gated-gelu"))
    inferred = _text_config({k: tuple(v.shape) for k, v in qwen.state_dict().items()})
    text, vision = inferred["text_config"], inferred["vision_config"]
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["rope_scaling"]["mrope_section"]) == \
           (28, 4, [16, 24, 24])
    assert (vision["num_heads"], vision["depth"], vision["spatial_merge_size"], vision["patch_size"]) == (16, 32, 2, 14)
    t5 = t5_encoder_config({k: tuple(v.shape) for k, v in umt5.state_dict().items()}, "umt5")
    assert (t5["num_heads"], t5["d_kv"], t5["d_ff"], t5["num_layers"]) == (64, 64, 10240, 24)


def test_the_vae_layout_shared_by_qwen_image_and_wan_needs_the_other_files(released_models):
    files = _files(released_models("qwen_image"), "qwen_image", "vae")
    assert {family for family, _ in released.recognise(FORMATS, files)} == {"qwen_image", "wan"}


class _RunsCode:
    def __reduce__(self):
        import os

        return os.system, ("touch pwned",)


def test_a_pickle_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "Wan2.1_VAE.pth"
    with open(path, "wb") as handle:
        pickle.dump({"encoder.conv1.weight": _RunsCode()}, handle)
    with pytest.raises(InputError, match="Wan2.1_VAE.pth"):
        load_weights(path)
    assert not (tmp_path / "pwned").exists()


def test_weights_that_fit_no_format_are_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"something.else.weight": torch.zeros(2, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(InputError, match="x.safetensors.*not a transformer"):
        released.find_format(get_family("flux").released_formats, "transformer", [tmp_path / "x.safetensors"])


MEMORY_CHILD = r"""
import json, sys, torch
from pathlib import Path
def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))
from diffsynth_core.models import get_family, released
import accelerate, diffusers, safetensors.torch, transformers  # imported before the baseline
from diffusers import FluxTransformer2DModel
from transformers import UMT5EncoderModel
peaks = {}
for family, component, path in json.loads(sys.argv[1]):
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    base = status("VmRSS")
    model = released.load_named(get_family(family).released_formats, component, [Path(path)], torch.bfloat16)
    touched = sum(float(p.float().sum()) for p in model.parameters())  # page every weight in
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # as from_pretrained(dtype=bf16) leaves them
    peaks[family] = status("VmHWM") - base
    del model
print(json.dumps(peaks))
"""


@pytest.fixture(scope="module")
def large_release_files(tmp_path_factory):
    """~50 MB bf16 files as released: a BFL-named FLUX DiT and Wan's pickled T5 (.pth)."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file
    from transformers import UMT5Config, UMT5EncoderModel

    from diffsynth_core.models.wan_released import umt5_to_native_t5

    folder = tmp_path_factory.mktemp("large")
    dit = FluxTransformer2DModel(num_layers=1, num_single_layers=2, attention_head_dim=128, num_attention_heads=4,
                                 joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=True)
    state = {k: v.to(torch.bfloat16) for k, v in dit.state_dict().items()}
    save_file(diffusers_to_bfl(state), str(folder / "flux1-dev.safetensors"))
    t5 = UMT5EncoderModel(UMT5Config(vocab_size=8000, d_model=768, d_kv=64, d_ff=2048, num_layers=3, num_heads=12,
                                     feed_forward_proj="gated-gelu", relative_attention_num_buckets=32))
    native = {k: v.to(torch.bfloat16) for k, v in umt5_to_native_t5(t5.state_dict()).items()}
    torch.save(native, folder / "models_t5_umt5-xxl-enc-bf16.pth")
    files = [("flux", "transformer", str(folder / "flux1-dev.safetensors")),
             ("wan", "text_encoder", str(folder / "models_t5_umt5-xxl-enc-bf16.pth"))]
    return files, {"flux": sum(v.numel() * 2 for v in state.values()), "wan": sum(v.numel() * 2 for v in native.values())}


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_released_files_load_at_about_one_model_size(large_release_files):
    """The BFL DiT (split into views) and the .pth (memory-mapped) cost ~1x their size, never 2x."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    files, sizes = large_release_files
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    result = subprocess.run([sys.executable, "-c", MEMORY_CHILD, json.dumps(files)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    peaks = json.loads(result.stdout.strip().splitlines()[-1])
    for family, peak in peaks.items():
        assert peak < 1.5 * sizes[family], f"{family}: peak {peak / 1e6:.0f} MB for {sizes[family] / 1e6:.0f} MB"
