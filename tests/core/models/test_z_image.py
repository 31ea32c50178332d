"""Z-Image's own facts: its files as released (DiffSynth's download of the diffusers subfolders, ComfyUI's
single files) load the reference model; configs inferred from the released shapes are the released
configs; Turbo and base are told apart by the model id alone, or the run names the choices."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family, known_families, released
from diffsynth_core.models.loading import load_component as load_reference
from diffsynth_core.models.z_image_released import diffusers_to_native, native_to_diffusers

from .released_layouts import MODEL_IDS, Z_IMAGE_BASE_ID, assert_configs_inferred, ldm_vae_names

SPEC = get_family("z_image")
FORMATS = {name: get_family(name).released_formats for name in known_families()}
# As DiffSynth's examples/z_image/model_training/lora/Z-Image-Turbo.sh names them.
SCRIPT_FILES = {"transformer": "transformer/*.safetensors", "text_encoder": "text_encoder/*.safetensors",
                "vae": "vae/diffusion_pytorch_model.safetensors"}


def _same_model(model, reference):
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.fixture(scope="module")
def release(released_models):
    return released_models("z_image")


def test_diffsynth_downloads_without_configs_load_the_reference_model(release):
    base = release / "models" / MODEL_IDS["z_image"]
    for component, pattern in SCRIPT_FILES.items():
        files = sorted(base.glob(pattern))
        assert not [f for f in files if f.name == "config.json"]
        assert "z_image" in {family for family, fmt in released.recognise(FORMATS, files) if fmt.component == component}
        model = released.load_named(SPEC.released_formats, component, files, torch.float32)
        reference = load_reference(release / "reference", component, torch.float32)
        _same_model(model, reference)
        if component == "text_encoder":
            ids = torch.tensor([[3, 7, 11, 5, 1]])
            torch.testing.assert_close(model(input_ids=ids)[0], reference(input_ids=ids)[0], rtol=0, atol=0)
        else:
            assert {k: v for k, v in dict(model.config).items() if not k.startswith("_")} == \
                   {k: v for k, v in dict(reference.config).items() if not k.startswith("_")}


def test_comfyui_single_files_load_the_reference_model(release, tmp_path):
    """z_image_turbo_bf16.safetensors (original DiT names, q/k/v fused), qwen_3_4b.safetensors
    (Qwen3ForCausalLM's ``model.`` names) and ae.safetensors (FLUX.1's VAE, ldm names)."""
    reference = release / "reference"
    dit = load_file(str(reference / "transformer" / "diffusion_pytorch_model.safetensors"))
    native = diffusers_to_native(dit)
    assert not [k for k in native if ".to_q." in k or k.startswith(("all_x_embedder", "all_final_layer"))]
    save_file({"model.diffusion_model." + k: v for k, v in native.items()}, str(tmp_path / "z_image_turbo.safetensors"))
    text = load_file(str(reference / "text_encoder" / "model.safetensors"))
    save_file({"model." + k.removeprefix("model."): v for k, v in text.items()}, str(tmp_path / "qwen_3_4b.safetensors"))
    save_file(ldm_vae_names(load_file(str(reference / "vae" / "diffusion_pytorch_model.safetensors"))),
              str(tmp_path / "ae.safetensors"))
    for component, name in (("transformer", "z_image_turbo"), ("text_encoder", "qwen_3_4b"), ("vae", "ae")):
        model = released.load_named(SPEC.released_formats, component, [tmp_path / f"{name}.safetensors"], torch.float32)
        _same_model(model, load_reference(reference, component, torch.float32))
    # the family's single-file loader reads the same file through the same converter
    loaded = SPEC.load_transformer_file(tmp_path / "z_image_turbo.safetensors", reference, torch.float32)
    _same_model(loaded, load_reference(reference, "transformer", torch.float32))


def test_fixture_inverse_agrees_with_diffusers_converter(release):
    dit = load_file(str(release / "reference" / "transformer" / "diffusion_pytorch_model.safetensors"))
    back = native_to_diffusers(diffusers_to_native(dit))
    assert back.keys() == dit.keys() and all(torch.equal(back[k], dit[k]) for k in dit)


def test_configs_inferred_from_released_shapes_are_the_released_configs():
    from accelerate import init_empty_weights
    from transformers import Qwen3Config, Qwen3Model

    from diffsynth_core.models.z_image import ENCODER_CONFIGS
    from diffsynth_core.models.z_image_released import _qwen3_config

    model = SPEC.build_transformer("Z-Image-Turbo", torch.bfloat16, "meta")
    assert_configs_inferred(SPEC, model, diffusers_to_native)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(6.15e9, rel=0.01)
    with init_empty_weights():
        text = Qwen3Model(Qwen3Config(**ENCODER_CONFIGS["Z-Image-Turbo"]["text"]))
    inferred = _qwen3_config({"model." + k: tuple(v.shape) for k, v in text.state_dict().items()})
    for key, value in ENCODER_CONFIGS["Z-Image-Turbo"]["text"].items():
        assert inferred[key] == value, key


@pytest.mark.parametrize("path, variant", [
    ("models/Tongyi-MAI/Z-Image-Turbo/transformer/diffusion_pytorch_model-00001-of-00003.safetensors", "turbo"),
    ("models/Tongyi-MAI/Z-Image/transformer/diffusion_pytorch_model-00001-of-00002.safetensors", "base"),
    ("/hub/models--Tongyi-MAI--Z-Image-Turbo/snapshots/abc", "turbo"),
    ("/hub/models--Tongyi-MAI--Z-Image/snapshots/abc", "base"),
    ("/data/my_finetune", None),
])
def test_the_variant_comes_from_the_model_id_in_the_path(path, variant):
    from pathlib import Path

    assert SPEC.variant_of(Path(path)) == variant


def test_a_run_whose_files_cannot_tell_the_variant_names_the_choices(tmp_path):
    from stages.common import family_of
    from stages.config import build_config

    data = {"dataset": {"base_path": str(tmp_path), "metadata_path": str(tmp_path / "m.csv")},
            "model": {"family": "z_image", "path": str(tmp_path / "my_model")},
            "cache": {"url": str(tmp_path / "c.zarr")}, "output": {"path": str(tmp_path / "out")}}
    with pytest.raises(InputError, match="set model.variant to one of: base, turbo") as error:
        family_of(build_config(data, [], source="test"))
    assert error.value.exit_code == 2
    sources = {"transformer": [str(tmp_path / "models/Tongyi-MAI/Z-Image/transformer/a.safetensors")]}
    spec = family_of(build_config({**data, "model": {"family": "z_image", "sources": sources}}, [], source="test"))
    assert spec.variant == "base" and not spec.extras["distilled"] and spec.extras["latent_channels"] == 16
    turbo = family_of(build_config(data, ["model.variant=turbo"], source="test"))
    assert turbo.variant == "turbo" and "preset_lora_path" in turbo.extras["training_notice"]


def test_training_turbo_without_an_adapter_logs_the_reference_recommendation_once(caplog):
    from diffsynth_core.training.prepare import prepare_for_training
    from stages.config import OffloadSection, TrainSection

    turbo = get_family("z_image", "turbo")
    model = turbo.build_transformer("tiny", torch.float32, "cpu")
    offload = OffloadSection(enable_model_cpu_offload=False)
    with caplog.at_level("WARNING", logger="diffsynth_core.training.prepare"):
        prepare_for_training(model, turbo, TrainSection(lora_rank=4), offload, torch.device("cpu"))
    notices = [r.getMessage() for r in caplog.records if "distilled" in r.getMessage()]
    assert notices == [turbo.extras["training_notice"]]
    caplog.clear()
    base = get_family("z_image", "base")
    with caplog.at_level("WARNING", logger="diffsynth_core.training.prepare"):
        prepare_for_training(base.build_transformer("tiny", torch.float32, "cpu"), base, TrainSection(lora_rank=4),
                             offload, torch.device("cpu"))
    assert not [r for r in caplog.records if "distilled" in r.getMessage()]


def test_split_training_step_one_finds_z_image_from_its_encoders_and_asks_for_the_variant(released_models,
                                                                                          monkeypatch):
    """DiffSynth's split-training first step names only the encoders: Qwen3 and the FLUX.1 VAE are
    Z-Image's alone, but without the DiT no file tells Turbo from base."""
    from stages.common import family_of
    from stages.compat.diffsynth import run_config_from_cli

    monkeypatch.chdir(released_models("z_image"))
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    flags = ["--model_id_with_origin_paths", "Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,"
             "Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors", "--dataset_base_path", "data",
             "--dataset_metadata_path", "data/m.csv", "--output_path", "cache", "--task", "sft:data_process"]
    cfg = run_config_from_cli(None, [], flags, "run")
    assert cfg.model.family == "z_image" and set(cfg.model.sources) == {"text_encoder", "vae", "tokenizer"}
    with pytest.raises(InputError, match="set model.variant to one of: base, turbo"):
        family_of(cfg)
    assert family_of(run_config_from_cli(None, ["model.variant=turbo"], flags, "run")).variant == "turbo"
