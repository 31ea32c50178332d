"""FLUX.2's own facts: its files as released (DiffSynth's config-less downloads, BFL's single DiT files) load the
reference model; configs inferred from the released shapes are the released configs; stage 1's encoder-only
loaders encode as the pipelines do; the variants come from the files or the run names the choices; a distilled
klein trained as a base model says what the reference recommends; the ComfyUI LoRA reads back exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family, known_families, released
from diffsynth_core.models.flux2_released import bfl_to_diffusers, diffusers_to_bfl
from diffsynth_core.models.loading import load_component as load_reference

from .released_layouts import MODEL_IDS, assert_configs_inferred, plain_config

FORMATS = {name: get_family(name).released_formats for name in known_families()}
# As DiffSynth's examples/flux2/model_training/lora/FLUX.2-*.sh name them.
SCRIPT_FILES = {"transformer": "transformer/*.safetensors", "text_encoder": "text_encoder/*.safetensors",
                "vae": "vae/diffusion_pytorch_model.safetensors"}
DEV, KLEIN = MODEL_IDS["flux2"], "black-forest-labs/FLUX.2-klein-4B"


def _same_weights(model, reference):
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.fixture(scope="module")
def release(released_models):
    return released_models("flux2")


@pytest.mark.parametrize("model_id, reference", [(DEV, "reference-dev"), (KLEIN, "reference")])
def test_diffsynth_downloads_without_configs_load_the_reference_model(release, model_id, reference):
    """Each component recognised as FLUX.2's from its keys; Mistral3 is read as its text decoder alone, whose
    hidden states are the reference Mistral3's."""
    spec = get_family("flux2")
    for component, pattern in SCRIPT_FILES.items():
        files = sorted((release / "models" / model_id).glob(pattern))
        assert files and not [f for f in files if f.name == "config.json"]
        assert "flux2" in {name for name, fmt in released.recognise(FORMATS, files) if fmt.component == component}
        model = released.load_named(spec.released_formats, component, files, torch.float32)
        full = load_reference(release / reference, component, torch.float32)
        if component != "text_encoder":
            _same_weights(model, full)
            assert plain_config(model.config) == plain_config(full.config)
            continue
        ids = torch.tensor([[3, 7, 11, 5, 1]])
        ours = model(input_ids=ids, output_hidden_states=True).hidden_states
        theirs = full(input_ids=ids, output_hidden_states=True).hidden_states
        assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
        if model_id == DEV:
            assert type(model).__name__ == "MistralModel"  # no vision tower, projector or LM head in memory


def test_bfl_single_files_load_the_reference_dit_both_ways(release, tmp_path):
    """flux2-dev.safetensors' names (the inverse of diffusers' converter here, checked both ways) through the
    released formats and through model.transformer_file; ComfyUI's prefix is stripped."""
    reference = release / "reference-dev"
    dit = load_file(str(reference / "transformer" / "diffusion_pytorch_model.safetensors"))
    native = diffusers_to_bfl(dit)
    assert "double_blocks.0.img_attn.qkv.weight" in native and not any(".to_q." in k for k in native)
    back = bfl_to_diffusers(dict(native))
    assert back.keys() == dit.keys() and all(torch.equal(back[k], dit[k]) for k in dit)
    file = tmp_path / "flux2-dev.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in native.items()}, str(file))
    expected = load_reference(reference, "transformer", torch.float32)
    _same_weights(released.load_named(get_family("flux2").released_formats, "transformer", [file], torch.float32),
                  expected)
    _same_weights(get_family("flux2", "dev").load_transformer_file(file, reference, torch.float32), expected)
    assert get_family("flux2").variant_of(file) == "dev"  # the release's name
    renamed = tmp_path / "my_finetune.safetensors"  # no name: dev's width (6144) is no klein's...
    save_file({"img_in.weight": torch.zeros(6144, 2)}, str(renamed))
    assert get_family("flux2").variant_of(renamed) == "dev"
    file.rename(renamed)  # ...while klein's widths say 4B or 9B but not base or distilled (nor does a tiny one)
    assert get_family("flux2").variant_of(renamed) is None


@pytest.mark.parametrize("layout, parameters", [("FLUX.2-dev", 32.2e9), ("FLUX.2-klein-4B", 3.88e9),
                                                ("FLUX.2-klein-9B", 9.08e9)])
def test_configs_inferred_from_released_shapes_are_the_released_configs(layout, parameters):
    spec = get_family("flux2")
    model = spec.build_transformer(layout, torch.bfloat16, "meta")
    assert_configs_inferred(spec, model, diffusers_to_bfl)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(parameters, rel=0.01)


def test_mistral_small_config_inferred_from_its_released_shapes():
    """FLUX.2-dev's text encoder as released (DiffSynth's flux2_text_encoder.py: language_model.model.* names)."""
    from accelerate import init_empty_weights
    from transformers import MistralConfig, MistralModel

    from diffsynth_core.models.flux2 import ENCODER_CONFIGS
    from diffsynth_core.models.flux2_released import mistral_config

    layout = {k: v for k, v in ENCODER_CONFIGS["FLUX.2-dev"].items() if k != "model_type"}
    with init_empty_weights():
        text = MistralModel(MistralConfig(**layout))
    shapes = {"language_model.model." + k: tuple(v.shape) for k, v in text.state_dict().items()}
    shapes["vision_tower.transformer.layers.0.attention.q_proj.weight"] = (1024, 1024)
    inferred = mistral_config(shapes)
    for key, value in layout.items():
        assert inferred[key] == value, key
    assert sum(p.numel() for p in text.parameters()) == pytest.approx(22.9e9, rel=0.01)  # no LM head (0.67 B)


def test_the_benchmarks_released_encoders_feed_the_released_dits():
    """Three stacked hidden layers of each text encoder are the DiT's context width; dev's is Mistral's text
    decoder, which its variant encodes with."""
    from diffsynth_core.models.flux2 import ENCODER_CONFIGS, TRANSFORMER_CONFIGS, _check_text_encoder

    for layout in ("FLUX.2-dev", "FLUX.2-klein-4B", "FLUX.2-klein-9B"):
        assert 3 * ENCODER_CONFIGS[layout]["hidden_size"] == TRANSFORMER_CONFIGS[layout]["joint_attention_dim"]
    dev = get_family("flux2", "dev")
    _check_text_encoder("mistral", dev.build_encoders(*dev.encoder_variants, torch.bfloat16, "meta")["text_encoder"])


# --- stage 1 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant, reference", [("dev", "reference-dev"), ("klein-base-4b", "reference")])
def test_stage_one_encoders_encode_as_the_pipeline_at_its_default_length(release, variant, reference):
    """load_encoders (dev: Mistral's text decoder alone, the tokenizer as DiffSynth loads it) at the pipelines'
    default 512 tokens; a prompt of another length pads alike."""
    import diffusers

    spec = get_family("flux2", variant)
    folder, prompts = release / reference, ["a red cat", "a photo of a dog"][: 2 if variant == "dev" else 1]
    ours = spec.encode_prompts(spec.load_encoders(folder, torch.float32), prompts, "cpu")
    pipe = getattr(diffusers, spec.pipeline_class_name).from_pretrained(folder)
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(prompts)
    assert [o["prompt_embeds"].shape for o in ours] == [(512, 48)] * len(prompts)
    assert all(torch.equal(o["prompt_embeds"], t) for o, t in zip(ours, theirs))


@pytest.mark.parametrize("variant, kind", [("dev", "mistral"), ("klein-base-4b", "qwen3")])
def test_stage_one_drops_the_text_layers_after_the_last_one_read_and_encodes_as_the_whole_model(variant, kind):
    """Released Mistral has 40 layers and the pipeline reads 10, 20, 30 (klein's Qwen3: 36, and 9, 18, 27):
    the encoder keeps one layer past the last read (its input is that hidden state; the final norm is not)."""
    import copy

    from diffsynth_core.models import encoders, flux2, tiny_tokenizers

    last = max(flux2.READ_LAYERS[kind])
    tokenizer = tiny_tokenizers.mistral_tokenizer() if kind == "mistral" else tiny_tokenizers.qwen2_tokenizer()
    torch.manual_seed(0)
    whole = (flux2.tiny_mistral if kind == "mistral" else flux2.tiny_qwen3)(len(tokenizer), layers=last + 4).eval()
    kept = encoders.drop_layers_after(copy.deepcopy(whole), last)
    decoder = kept.model.language_model if kind == "mistral" else kept.model
    assert len(decoder.layers) == decoder.config.num_hidden_layers == last + 1
    assert len(kept.model.vision_tower.transformer.layers if kind == "mistral" else []) == \
        len(whole.model.vision_tower.transformer.layers if kind == "mistral" else [])  # the vision tower keeps its own
    prompts = ["a red cat", "a photo of a dog on a sofa"]
    method = "_get_mistral_3_small_prompt_embeds" if kind == "mistral" else "_get_qwen3_prompt_embeds"
    with torch.no_grad():  # the pipeline's own encoding on the whole model, at its default layers
        theirs = getattr(flux2._pipeline_cls(kind), method)(text_encoder=whole, tokenizer=tokenizer, prompt=prompts,
                                                            device=torch.device("cpu"), max_sequence_length=64)
    ours = get_family("flux2", variant).encode_prompts({"text_encoder": kept, "tokenizer": tokenizer}, prompts, "cpu",
                                                        max_sequence_length=64)
    assert all(torch.equal(o["prompt_embeds"], t) for o, t in zip(ours, theirs))


def test_a_variant_given_the_other_text_encoder_is_refused(release):
    klein = get_family("flux2", "klein-base-4b")
    components = get_family("flux2", "dev").load_encoders(release / "reference-dev", torch.float32)
    with pytest.raises(InputError, match="MistralModel.*Qwen3"):
        klein.encode_prompt(components, "a red cat", "cpu")


# --- variants ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, variant", [
    ("models/black-forest-labs/FLUX.2-dev/transformer/diffusion_pytorch_model-00001-of-00007.safetensors", "dev"),
    ("models/black-forest-labs/FLUX.2-klein-4B/transformer/diffusion_pytorch_model.safetensors", "klein-4b"),
    ("models/black-forest-labs/FLUX.2-klein-base-9B/transformer/a.safetensors", "klein-base-9b"),
    ("/hub/models--black-forest-labs--FLUX.2-klein-9B/snapshots/abc", "klein-9b"),
    ("/comfy/models/diffusion_models/flux-2-klein-base-4b.safetensors", "klein-base-4b"),
    ("/data/my_finetune", None),
])
def test_the_variant_comes_from_the_release_name_in_the_path(path, variant):
    assert get_family("flux2").variant_of(Path(path)) == variant


def test_a_diffusers_folder_tells_its_variant_by_pipeline_distillation_and_width(release, tmp_path):
    import json
    import shutil

    spec = get_family("flux2")
    assert spec.variant_of(release / "reference-dev") == "dev"
    assert spec.variant_of(release / "reference") is None  # klein at a tiny width: neither 4B nor 9B
    for distilled, heads, variant in ((True, 24, "klein-4b"), (False, 32, "klein-base-9b")):
        folder = tmp_path / variant
        (folder / "transformer").mkdir(parents=True)
        index = json.loads((release / "reference" / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**index, "is_distilled": distilled}))
        config = json.loads((release / "reference" / "transformer" / "config.json").read_text())
        (folder / "transformer" / "config.json").write_text(json.dumps({**config, "num_attention_heads": heads,
                                                                        "attention_head_dim": 128}))
        assert spec.variant_of(folder) == variant
        shutil.rmtree(folder)


def _config(tmp_path, model: dict, *sets):
    from stages.config import build_config

    data = {"dataset": {"base_path": str(tmp_path), "metadata_path": str(tmp_path / "m.csv")},
            "model": {"family": "flux2", **model}, "cache": {"url": str(tmp_path / "c.zarr")},
            "output": {"path": str(tmp_path / "out")}}
    return build_config(data, list(sets), source="test")


def test_encoders_alone_tell_dev_and_nothing_else_tells_klein_apart(release, tmp_path):
    """A split run's first stage names only the encoders: Mistral is dev's alone; klein's Qwen3 serves base and
    distilled, so the run names the choices (exit 2) until model.variant says."""
    from stages.common import family_of

    def sources(model_id):
        folder = release / "models" / model_id
        return {"text_encoder": [str(p) for p in sorted((folder / "text_encoder").glob("*.safetensors"))],
                "vae": [str(folder / "vae" / "diffusion_pytorch_model.safetensors")]}

    assert family_of(_config(tmp_path, {"sources": sources(DEV)})).variant == "dev"
    with pytest.raises(InputError, match="set model.variant to one of: dev, klein-4b, klein-9b, klein-base-4b, "
                                         "klein-base-9b") as error:
        family_of(_config(tmp_path, {"sources": sources(KLEIN)}))
    assert error.value.exit_code == 2
    assert family_of(_config(tmp_path, {"sources": sources(KLEIN)}, "model.variant=klein-4b")).variant == "klein-4b"


def test_base_and_distilled_klein_share_their_prompt_entries(release, tmp_path):
    """Their prompts encode alike (one text encoder, one template), so a split run's first stage may name either."""
    from stages.keys import identities

    model = {"path": str(release / "reference")}
    texts = [identities(_config(tmp_path, model), get_family("flux2", v))[2] for v in ("klein-4b", "klein-base-4b")]
    assert texts[0] == texts[1]
    assert identities(_config(tmp_path, model), get_family("flux2", "dev"))[2] != texts[0]


def test_a_distilled_klein_trained_as_a_base_model_logs_the_recommendation_once(caplog):
    from diffsynth_core.training.prepare import prepare_for_training
    from stages.config import OffloadSection, TrainSection

    offload = OffloadSection(enable_model_cpu_offload=False)
    for variant in ("klein-4b", "klein-base-4b", "dev"):
        spec = get_family("flux2", variant)
        caplog.clear()
        with caplog.at_level("WARNING", logger="diffsynth_core.training.prepare"):
            prepare_for_training(spec.build_transformer("tiny", torch.float32, "cpu"), spec, TrainSection(lora_rank=4),
                                 offload, torch.device("cpu"))
        notices = [r.getMessage() for r in caplog.records if "distilled" in r.getMessage()]
        assert notices == ([spec.extras["training_notice"]] if variant == "klein-4b" else []), variant
    assert "FLUX.2-klein-base-4B" in get_family("flux2", "klein-4b").extras["training_notice"]


# --- LoRA files --------------------------------------------------------------------------------------

def test_the_comfyui_file_continues_as_the_trained_lora(tmp_path):
    """Read back through BFL/kohya names (fused q/k/v split by their block-diagonal B), every module's update
    is the trained one: a LoRA from ComfyUI's or musubi-tuner's world continues here."""
    from diffsynth_core.training.lora import inject_lora, lora_state_dict, read_lora_file

    spec = get_family("flux2")
    model = spec.build_transformer("tiny", torch.float32, "cpu")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    config = inject_lora(model, sorted(linears), 4, 6.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    peft = lora_state_dict(model)
    path = spec.export_lora(peft, config, tmp_path)["comfyui"]
    loras = read_lora_file(path, linears, spec.native_module_name)
    assert set(loras) == {k.rsplit(".lora_", 1)[0] for k in peft}
    for module, lora in loras.items():
        expected = 1.5 * peft[module + ".lora_B.weight"] @ peft[module + ".lora_A.weight"]
        torch.testing.assert_close(lora.alpha / lora.rank * lora.up @ lora.down, expected, rtol=0, atol=1e-6)


# --- datasets: references --------------------------------------------------------------------------

def _drawn(path: Path, size: tuple[int, int], colour: str) -> Path:
    from PIL import ImageDraw

    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).ellipse((size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2), fill=colour)
    image.save(path)
    return path


def as_pixels(image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 127.5 - 1


def test_edit_images_are_cropped_to_about_a_megapixel_as_diffsynth_resizes_them(tmp_path):
    """DiffSynth's edit_image list: each reference covers calculate_dimensions(1024², aspect) (sides rounded to
    32) and is centre-cropped (Flux2Unit_EditImageEmbedder.edit_image_auto_resize), not stretched."""
    import csv
    import json

    from diffsynth_core.data.references import area_size, resized
    from diffsynth_core.data.resize import crop_and_resize
    from stages.datasets import open_dataset

    _drawn(tmp_path / "target.png", (96, 64), "red")
    first, second = _drawn(tmp_path / "a.png", (300, 200), "blue"), _drawn(tmp_path / "b.png", (90, 160), "green")
    with open(tmp_path / "m.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["image", "prompt", "edit_image"])
        writer.writeheader()
        writer.writerow({"image": "target.png", "prompt": "x", "edit_image": json.dumps(["a.png", "b.png"])})
    cfg = _config(tmp_path, {"variant": "klein-base-4b"}, "dataset.data_file_keys=['image','edit_image']")
    sample = open_dataset(cfg.dataset, get_family("flux2", "klein-base-4b")).load(0)
    assert [p.name for p in sample.files] == ["target.png", "a.png", "b.png"]
    for reference, path in zip(sample.references, (first, second)):
        image = Image.open(path)
        height, width = area_size(image.height, image.width, 1024 * 1024, 32)
        assert reference.shape == (3, 1, height, width)
        assert torch.allclose(reference[:, 0], as_pixels(crop_and_resize(image, height, width)), atol=1e-6)
        assert not torch.allclose(reference[:, 0], as_pixels(resized(image, height, width)), atol=1e-2)


def test_a_musubi_toml_with_control_images_gives_flux2_its_references(tmp_path):
    """musubi-tuner's FLUX.2 dataset config (docs/flux_2.md: control images are the references): same-stem
    controls in order, sized to about control_resolution's area."""
    from stages.config import build_config
    from stages.datasets import open_dataset

    images, controls = tmp_path / "images", tmp_path / "controls"
    images.mkdir(), controls.mkdir()
    _drawn(images / "cat.png", (128, 96), "red")
    (images / "cat.txt").write_text("edit the cat")
    _drawn(controls / "cat_0.png", (96, 96), "blue")
    _drawn(controls / "cat_1.png", (64, 128), "green")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [128, 96]\nenable_bucket = true\n[[datasets]]\n'
                    f'image_directory = "{images}"\ncontrol_directory = "{controls}"\ncontrol_resolution = [64, 64]\n')
    cfg = build_config({"dataset": {"metadata_path": str(toml)}, "model": {"family": "flux2", "variant": "klein-4b"}})
    sample = open_dataset(cfg.dataset, get_family("flux2", "klein-4b")).load(0)
    assert sample.prompt == "edit the cat" and [p.name for p in sample.files] == ["cat.png", "cat_0.png", "cat_1.png"]
    assert [tuple(r.shape[-2:]) for r in sample.references] == [(64, 64), (96, 32)]


def test_a_diffsynth_flux2_cache_is_refused_with_what_to_do(tmp_path):
    from stages.compat.diffsynth_cache import import_cache

    with pytest.raises(InputError, match="flux2 caches cannot be imported; encode the dataset with `splitflow "
                                         "preprocess`"):
        import_cache(str(tmp_path / "cache"), str(tmp_path / "dest.zarr"), family="flux2")
