"""Wan2.2 variants of the ``wan`` family: which folder is which, and TI2V-5B's latent layout.

(Stage-1 outputs, ``dit_forward`` and LoRA reloads against ``WanPipeline`` are the conformance
suite's ``wan_ti2v_5b`` case.)
"""

from __future__ import annotations

import json

import pytest
import torch

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family
from diffsynth_core.models.wan22 import variant_of


@pytest.fixture(scope="module")
def ti2v_dir(tmp_path_factory):
    return get_family("wan", "ti2v-5b").save_tiny_model(tmp_path_factory.mktemp("ti2v") / "model", 0)


@pytest.fixture(scope="module")
def a14b_dir(tmp_path_factory):
    return get_family("wan", "t2v-a14b").save_tiny_model(tmp_path_factory.mktemp("a14b") / "model", 0)


def test_each_folder_tells_its_variant(ti2v_dir, a14b_dir, tmp_path):
    assert variant_of(ti2v_dir) == "ti2v-5b"
    assert variant_of(a14b_dir) == "t2v-a14b"
    wan21 = get_family("wan").save_tiny_model(tmp_path / "wan21", 0)
    assert variant_of(wan21) == "t2v"
    assert variant_of(None) == "t2v"  # files as released, no folder: Wan2.1's layout as before
    for variant in ("i2v", "i2v-a14b", "i2v-a14b-expert"):  # with CLIP, two experts, one expert alone
        folder = get_family("wan", variant).save_tiny_model(tmp_path / variant, 0)
        assert variant_of(folder) == variant


def test_family_of_resolves_the_folders_variant_and_refuses_an_unknown_one(ti2v_dir):
    from stages.common import family_of
    from stages.config import RunConfig

    cfg = RunConfig.model_validate({"model": {"family": "wan", "path": str(ti2v_dir)}})
    spec = family_of(cfg)
    assert spec.variant == "ti2v-5b" and spec.extras["latent_channels"] == 48
    bad = RunConfig.model_validate({"model": {"family": "wan", "path": str(ti2v_dir), "variant": "wan9"}})
    with pytest.raises(InputError, match="wan9.*ti2v-5b"):
        family_of(bad)


def test_ti2v_latents_are_48_channels_at_16x_and_sizes_must_be_multiples_of_32(ti2v_dir):
    spec = get_family("wan", "ti2v-5b")
    comps = spec.load_components(ti2v_dir, ("vae",), torch.float32, "cpu")
    pixels = torch.rand(3, 5, 64, 96) * 2 - 1
    assert spec.encode_pixels(comps, pixels, "cpu")["latents"].shape == (48, 2, 4, 6)
    with pytest.raises(ValueError, match="multiples of 32"):
        spec.encode_pixels(comps, torch.zeros(3, 5, 48, 48), "cpu")


def test_ti2v_dummy_inputs_match_its_dit(ti2v_dir):
    spec = get_family("wan", "ti2v-5b")
    dit = spec.load_components(ti2v_dir, ("transformer",), torch.float32, "cpu")["transformer"]
    latents, cond = spec.dummy_inputs(dit.config, batch=2, height=64, width=64, num_frames=5)
    assert latents.shape == (2, 48, 2, 4, 4)
    with torch.no_grad():
        assert spec.dit_forward(dit, latents, torch.tensor([0.3, 0.9]), cond).shape == latents.shape


def test_a14b_declares_its_two_experts_at_the_folders_boundary(a14b_dir):
    spec = get_family("wan", "t2v-a14b")
    assert [(e.component, e.sigma_min, e.sigma_max, e.label) for e in spec.experts] == [
        ("transformer", 0.875, 1.0, "high_noise"), ("transformer_2", 0.0, 0.875, "low_noise")]
    index = json.loads((a14b_dir / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"][1] == "WanTransformer3DModel"
