"""The Qwen-Image-Edit variants beyond the conformance suite: telling the variants apart from the
files, the reference latents against the edit pipelines' own, Edit-2511's zero_cond_t, the
processor from released files and DiffSynth's layout (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import check_model_folder, get_family, released
from stages.common import family_of
from stages.config import RunConfig

from .family_cases import edit_images


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny model folder of each edit variant."""
    root = tmp_path_factory.mktemp("edit")
    return {v: get_family("qwen_image", v).save_tiny_model(root / v, 0) for v in ("edit", "edit-2509", "edit-2511")}


def _config(**model):
    return RunConfig.model_validate({"model": {"family": "qwen_image", **model}})


def test_model_folders_tell_their_variant(folders):
    for variant, folder in folders.items():
        assert family_of(_config(path=str(folder))).variant == variant
        index = json.loads((folder / "model_index.json").read_text())
        assert index["processor"] == ["transformers", "Qwen2VLProcessor"]


def test_a_folder_of_another_variant_names_the_one_to_set(folders):
    with pytest.raises(InputError, match="model.variant = 'edit-2509'"):
        check_model_folder(get_family("qwen_image", "edit"), folders["edit-2509"])


def test_single_files_tell_what_they_can_and_refuse_the_rest(folders, tmp_path):
    spec = get_family("qwen_image")
    state = {"img_in.weight": torch.zeros(2, 2)}
    cases = {"qwen_image_fp8.safetensors": "qwen-image", "qwen_image_edit_2509_bf16.safetensors": "edit-2509",
             "Qwen-Image-Edit-2511.safetensors": "edit-2511", "qwen_image_edit_bf16.safetensors": None}
    for name, expected in cases.items():
        save_file(state, str(tmp_path / name))
        assert spec.variant_of(tmp_path / name) == expected, name
    # ComfyUI's Edit-2511 files carry a marker tensor, whatever their name
    save_file({**state, "model.diffusion_model.__index_timestep_zero__": torch.zeros(0)}, str(tmp_path / "x.safetensors"))
    assert spec.variant_of(tmp_path / "x.safetensors") == "edit-2511"
    # DiffSynth keeps downloads under the release's repository name
    shard = tmp_path / "models/Qwen/Qwen-Image-Edit/transformer/diffusion_pytorch_model-00001-of-00002.safetensors"
    shard.parent.mkdir(parents=True)
    save_file(state, str(shard))
    assert spec.variant_of(shard) == "edit"
    # Edit v1 or 2509 from one file alone: refused, naming the choices (exit code 2)
    with pytest.raises(InputError, match="set model.variant to one of: edit, edit-2509, edit-2511, qwen-image") as err:
        family_of(_config(sources={"transformer": [str(tmp_path / "qwen_image_edit_bf16.safetensors")]}))
    assert err.value.exit_code == 2
    assert family_of(_config(variant="edit-2509", sources={"transformer": [str(tmp_path / "x.safetensors")]})
                     ).variant == "edit-2509"


def test_reference_latents_equal_the_pipelines_image_latents(folders):
    """What stage 1 caches for a reference, packed as dit_forward packs it, is the edit pipeline's
    ``prepare_latents`` image_latents for the same (already resized) image."""
    from diffusers import QwenImageEditPlusPipeline

    spec = get_family("qwen_image", "edit-2509")
    components = spec.load_components(folders["edit-2509"], ("vae",), torch.float32, "cpu")
    pipe = QwenImageEditPlusPipeline(scheduler=None, vae=components["vae"], text_encoder=None, tokenizer=None,
                                     processor=None, transformer=None)
    images = [pipe.image_processor.preprocess(img, 64, 96 - 32 * i).unsqueeze(2) for i, img in enumerate(edit_images())]
    _, theirs = pipe.prepare_latents(images, 1, 16, 64, 64, torch.float32, "cpu", None)
    ours = [spec.encode_pixels(components, image[0], "cpu")["latents"] for image in images]
    packed = torch.cat([pipe._pack_latents(z[None, :, 0], 1, 16, *z.shape[-2:]) for z in ours], dim=1)
    assert torch.allclose(packed, theirs, atol=1e-6)


def test_edit_2511_modulates_references_at_t0_from_every_source(folders, tmp_path):
    spec = get_family("qwen_image", "edit-2511")
    folder = folders["edit-2511"]
    transformer = spec.load_components(folder, ("transformer",), torch.float32, "cpu")["transformer"]
    assert transformer.zero_cond_t and all(b.zero_cond_t for b in transformer.transformer_blocks)
    # a ComfyUI file (marker included) over a 2509 config still loads as 2511
    file = tmp_path / "dit.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in transformer.state_dict().items()}
              | {"model.diffusion_model.__index_timestep_zero__": torch.zeros(0)}, str(file))
    loaded = spec.load_transformer_file(file, folders["edit-2509"], torch.float32)
    assert loaded.zero_cond_t and loaded.config.zero_cond_t
    # released weights without config.json (DiffSynth's download) infer zero_cond_t from the variant
    weights = tmp_path / "released" / "diffusion_pytorch_model.safetensors"
    weights.parent.mkdir()
    save_file(transformer.state_dict(), str(weights))
    from_files = released.load_named(spec.released_formats, "transformer", [weights], torch.float32)
    assert from_files.zero_cond_t
    assert not released.load_named(get_family("qwen_image", "edit-2509").released_formats, "transformer", [weights],
                                   torch.float32).zero_cond_t


def test_processor_loads_from_a_release_folder_and_encodes_like_the_folder(folders):
    spec = get_family("qwen_image", "edit-2509")
    folder = folders["edit-2509"]
    processor = released.load_named(spec.released_formats, "processor",
                                    sorted((folder / "processor").iterdir()), torch.float32)
    components = spec.load_encoders(folder, torch.float32)
    from_release = dict(components, processor=processor)
    images = [list(edit_images())]
    ours = spec.encode_prompts(components, ["turn it blue"], "cpu", images=images)[0]
    theirs = spec.encode_prompts(from_release, ["turn it blue"], "cpu", images=images)[0]
    assert torch.equal(ours["prompt_embeds"], theirs["prompt_embeds"])


def test_rows_without_references_encode_as_text_to_image(folders):
    """DiffSynth's prompt unit: no edit image, Qwen-Image's template (34 tokens dropped)."""
    edit = get_family("qwen_image", "edit")
    components = edit.load_encoders(folders["edit"], torch.float32)
    mixed = edit.encode_prompts(components, ["a cat", "a dog"], "cpu", images=[[edit_images()[0]], []])
    alone = edit.encode_prompts(components, ["a dog"], "cpu")[0]
    assert torch.allclose(mixed[1]["prompt_embeds"], alone["prompt_embeds"], atol=1e-5)
    assert mixed[1]["prompt_embeds"].shape[0] == len(components["processor"].tokenizer("a dog").input_ids) + 5
    with pytest.raises(ValueError, match="one reference image"):
        edit.encode_prompts(components, ["a cat"], "cpu", images=[list(edit_images())])


def test_diffsynth_layout_brings_the_edit_processor(folders, tmp_path):
    from stages.compat.diffsynth_models import add_tokenizers

    base = tmp_path / "models"
    for repo, variant in (("Qwen/Qwen-Image-Edit-2509", "edit-2509"), ("Qwen/Qwen-Image-Edit", "edit")):
        (base / repo).mkdir(parents=True)
        for part in ("transformer", "processor", "tokenizer"):
            (base / repo / part).symlink_to(folders[variant] / part)
    (base / "Qwen/Qwen-Image").mkdir(parents=True)
    (base / "Qwen/Qwen-Image/tokenizer").symlink_to(folders["edit"] / "tokenizer")
    shard = base / "Qwen/Qwen-Image-Edit-2509/transformer/diffusion_pytorch_model.safetensors"
    sources = {"transformer": [str(shard)], "text_encoder": [str(folders["edit"] / "text_encoder")]}
    add_tokenizers("qwen_image", sources, {"model_base_path": str(base)})
    assert sources["processor"] == [str((base / "Qwen/Qwen-Image-Edit/processor").resolve())]  # DiffSynth's default
    assert family_of(_config(sources=sources)).variant == "edit-2509"


def test_validation_renders_an_edit_of_a_dataset_reference(folders, tmp_path):
    from PIL import Image

    from stages.validation import ValidationRenderer, first_references

    from .family_cases import small_references

    spec = get_family("qwen_image", "edit-2509")
    cfg = RunConfig.model_validate({
        "model": {"family": "qwen_image", "path": str(folders["edit-2509"]), "dtype": "float32"},
        "train": {"validation_prompts": ["make it blue"], "validation_steps": 1, "validation_inference_steps": 1},
        "output": {"path": str(tmp_path / "out")}})
    transformer = spec.load_components(folders["edit-2509"], ("transformer",), torch.float32, "cpu")["transformer"]

    class Row:  # a dataset row as the dataset gives it: references (3, 1, H, W) in [-1, 1]
        references = [torch.linspace(-1, 1, 3 * 32 * 48).reshape(3, 1, 32, 48)]

    references = first_references([None, Row()])
    assert [r.size for r in references] == [(48, 32)]
    renderer = ValidationRenderer(cfg, spec, (32, 32), references=references)
    seen = {}

    def first_call(module, args, kwargs, out):
        seen.setdefault("shapes", kwargs["img_shapes"])  # returns None: the output is left alone

    transformer.register_forward_hook(first_call, with_kwargs=True)
    with small_references():
        [path] = renderer(1, transformer)
    assert Image.open(path).size == (32, 32)
    assert len(seen["shapes"][0]) == 2  # the target and the reference went through the DiT


def test_model_zero_cond_t_overrides_the_files_at_load(folders):
    from stages.train import load_transformer

    cfg = _config(path=str(folders["edit-2509"]), dtype="float32")
    assert not load_transformer(cfg, family_of(cfg)).zero_cond_t
    if "zero_cond_t" in type(cfg.model).model_fields:  # model.zero_cond_t (None: the files' own)
        cfg = _config(path=str(folders["edit-2509"]), dtype="float32", zero_cond_t=True)
    else:  # before stages.config declares the key
        object.__setattr__(cfg.model, "zero_cond_t", True)
    transformer = load_transformer(cfg, family_of(cfg))
    assert transformer.zero_cond_t and all(b.zero_cond_t for b in transformer.transformer_blocks)


def test_the_drawn_edit_dataset_is_learnt_through_the_family(folders, tmp_path):
    """The demo's (reference, instruction, target) triples, encoded by the family as stage 1 does
    and trained as stage 2 calls dit_forward: the LoRA's loss falls on fixed noise."""
    import csv

    from PIL import Image

    from diffsynth_core.training.lora import inject_lora
    from stages.demo_edit import write_edit_dataset

    spec = get_family("qwen_image", "edit-2509")
    metadata = write_edit_dataset(tmp_path / "data", count=3)
    rows = list(csv.DictReader(metadata.open()))
    assert all(len(json.loads(r["edit_image"])) == 1 for r in rows)
    components = spec.load_encoders(folders["edit-2509"], torch.float32)

    def pixels(name):  # 96x96 drawings at 64x64 keep the tiny run short
        image = Image.open(tmp_path / "data" / name).convert("RGB").resize((64, 64))
        return torch.tensor(list(image.getdata()), dtype=torch.float32).T.reshape(3, 1, 64, 64) / 127.5 - 1

    batches = []
    for row in rows[:2]:  # two of one shape bucket
        [reference] = json.loads(row["edit_image"])
        image = Image.open(tmp_path / "data" / reference).convert("RGB")
        cond = spec.encode_prompts(components, [row["prompt"]], "cpu", images=[[image]])[0]
        cond["ref_latents_0"] = spec.encode_pixels(components, pixels(reference), "cpu")["latents"]
        target = spec.encode_pixels(components, pixels(row["image"]), "cpu")["latents"]
        batches.append((target[None], {k: v[None] for k, v in cond.items()}))
    transformer = spec.load_components(folders["edit-2509"], ("transformer",), torch.float32, "cpu")["transformer"]
    transformer.requires_grad_(False)
    inject_lora(transformer, list(spec.lora_target_modules), 8, 8)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-2)
    g = torch.Generator().manual_seed(0)
    noise = [(torch.randn(t.shape, generator=g), torch.rand(1, generator=g)) for t, _ in batches]
    losses = []
    for _ in range(8):
        total = 0.0
        for (target, cond), (eps, sigma) in zip(batches, noise):
            pred = spec.dit_forward(transformer, (1 - sigma) * target + sigma * eps, sigma, cond)
            loss = torch.nn.functional.mse_loss(pred, eps - target)
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    assert losses[-1] < 0.75 * losses[0], losses
