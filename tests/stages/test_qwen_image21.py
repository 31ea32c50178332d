"""Qwen-Image-2.1 through both stages on a tiny model: RGBA targets and references keep their alpha for the
VAE (RGB files an opaque one), the vision tower sees each reference's VAE pixels over white, the prompt
carries one slot per 2x2 reference latents, and a batch of edit and text-to-image rows trains."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from cache_store import open_cache
from diffsynth_core.data.media import over_white
from diffsynth_core.models import get_family
from diffsynth_core.training.metrics import read_metrics
from stages import preprocess, train
from stages.demo import demo_config
from stages.keys import make_plan

SPEC = get_family("qwen_image21")


def _image(path, mode, size, colour):
    image = Image.new(mode, size, (255, 255, 255, 0) if mode == "RGBA" else "white")
    ImageDraw.Draw(image).ellipse((8, 8, size[0] - 8, size[1] - 8), fill=colour)
    image.save(path)
    return path.name


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Rows: an RGBA target with an RGB reference, an RGB target with an RGBA reference, a text-to-image row."""
    root = tmp_path_factory.mktemp("qwen21")
    data = root / "dataset"
    data.mkdir()
    rows = [{"image": _image(data / "a.png", "RGBA", (64, 64), (200, 30, 30, 180)), "prompt": "make it red",
             "edit_image": _image(data / "a_ref.png", "RGB", (64, 32), "blue")},
            {"image": _image(data / "b.png", "RGB", (64, 64), "green"), "prompt": "a green circle on white",
             "edit_image": _image(data / "b_ref.png", "RGBA", (64, 32), (10, 10, 200, 90))},
            {"image": _image(data / "c.png", "RGB", (64, 64), "red"), "prompt": "a red circle", "edit_image": ""}]
    with open(data / "metadata.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    model = SPEC.save_tiny_model(root / "model", 0)

    def config(*overrides):
        return demo_config(root, "qwen_image21", [f"model.path={model}", "preprocess.parts=1", "train.batch_size=2",
                                                  "dataset.data_file_keys=['image','edit_image']",
                                                  "dataset.reference_pixels=2048",  # 64x32 references
                                                  "train.max_steps=3", "train.save_steps=0", "train.num_epochs=3",
                                                  *overrides])

    cfg = config()
    summary = preprocess.run(cfg)
    return cfg, summary, model, config


def test_stage_one_keeps_alpha_and_gives_the_prompt_a_slot_per_reference_latents(run):
    cfg, summary, model, _ = run
    assert summary.encoded == 3
    plan, store = make_plan(cfg), open_cache(cfg.cache_url, mode="r")
    components = SPEC.load_encoders(model, torch.float32)
    rgba_target, rgb_target = plan.dataset.load(0), plan.dataset.load(1)
    assert rgba_target.pixels.shape[0] == 4 and rgba_target.pixels[3].min() < -0.9  # transparent corners kept
    assert torch.equal(rgb_target.pixels[3], torch.ones_like(rgb_target.pixels[3]))  # opaque alpha for RGB
    for row in range(3):
        sample, entry = plan.dataset.load(row), store.get(plan.keys[row])
        latents = store.get(plan.latent_keys[row])["latents"]
        torch.testing.assert_close(latents, SPEC.encode_pixels(components, sample.pixels, "cpu")["latents"],
                                   rtol=1e-5, atol=1e-5)
        slots = int(entry["image_pad_mask"].sum())
        if row < 2:
            reference = entry["ref_latents_0"]
            assert reference.shape == (64, 1, 2, 4) and slots == 2 == reference.shape[-2] * reference.shape[-1] // 4
            image = sample.reference_images[0]
            assert image.size == (64, 32) and image.mode == "RGB"
            vae_view = Image.fromarray(((sample.references[0][:, 0].permute(1, 2, 0) + 1) * 127.5).round()
                                       .byte().numpy(), "RGBA")
            assert np.array_equal(np.asarray(image), np.asarray(over_white(vae_view)))
        else:
            assert slots == 0 and "ref_latents_0" not in entry


def test_a_batch_of_edit_and_text_to_image_rows_trains(run):
    cfg, _, _, _ = run
    summary = train.run(cfg)
    assert summary.steps == 3
    rows = read_metrics(cfg.output_dir / "metrics.csv")
    assert len(rows) == 3 and all(float(r["loss"]) > 0 for r in rows)
    assert any("+" in r["bucket"] for r in rows)  # target+reference buckets
    assert (cfg.output_dir / "lora_comfyui.safetensors").is_file()


def test_full_fine_tuning_with_ema_writes_the_weights_and_their_average(run):
    _, _, _, config = run
    cfg = config("train.trainable_models=['transformer']", "train.lora_rank=0", "train.ema_decay=0.5",
                 f"output.path={run[0].output_dir.parent / 'full'}")
    assert train.run(cfg).steps == 3
    trained, averaged = (load_file(str(cfg.output_dir / name)) for name in
                         ("transformer.safetensors", "transformer_ema.safetensors"))
    assert trained.keys() == averaged.keys() and any(not torch.equal(trained[k], averaged[k]) for k in trained)


def _prompt_side(entry):
    return {k: entry[k] for k in ("prompt_embeds", "prompt_embeds_mask", "image_pad_mask")}


def test_a_dropped_caption_of_an_edit_row_is_the_pipelines_empty_prompt_with_its_references(run):
    """Caption dropout on: stage 1 also writes each edit row's empty text encoded with its references, what
    QwenImage21Pipeline.encode_prompt gives for prompt="" and those images; the text-to-image row has none."""
    from diffusers import QwenImage21Pipeline

    _, _, model, config = run
    cfg = config("train.caption_dropout=0.5")
    preprocess.run(cfg)
    plan, store = make_plan(cfg), open_cache(cfg.cache_url, mode="r")
    assert sorted(plan.empty_keys) == [0, 1] and plan.keys == make_plan(config()).keys  # row keys unchanged
    pipe = QwenImage21Pipeline.from_pretrained(model, **SPEC.load_components(model, ("processor",), torch.float32,
                                                                             "cpu"))
    for row in (0, 1):
        own = store.get(plan.empty_keys[row])
        assert "ref_latents_0" not in own and int(own["image_pad_mask"].sum()) == 2  # one slot per 2x2 latents
        with torch.no_grad():
            embeds, mask, pad = pipe.encode_prompt("", image=plan.dataset.load(row).reference_images)
        assert mask is None and torch.equal(own["image_pad_mask"], pad[0])
        torch.testing.assert_close(own["prompt_embeds"], embeds[0], rtol=1e-5, atol=1e-5)


def test_caption_dropout_trains_each_edit_row_on_its_own_empty_prompt(run, monkeypatch):
    """Every caption dropped: edit rows train on their own empty prompt (slots for their references), the
    text-to-image row on the shared one; the DiT is handed exactly those tensors."""
    from diffsynth_core.models import qwen_image21
    from diffsynth_core.training import loop
    from diffsynth_core.training.batching import with_empty_prompt

    cfg, _, _, config = run
    cfg = config("train.caption_dropout=1.0", "train.max_steps=4", f"output.path={cfg.output_dir.parent / 'drop'}")
    preprocess.run(cfg)
    plan, store = make_plan(cfg), open_cache(cfg.cache_url, mode="r")
    own = {row: _prompt_side(store.get(key)) for row, key in plan.empty_keys.items()}
    shared = _prompt_side(train.load_empty_prompt(cfg, store, plan.text_fingerprint))
    swapped, fed = [], []
    monkeypatch.setattr(loop, "with_empty_prompt", lambda entry, empty: swapped.append(
        (entry["meta"]["row"], empty)) or with_empty_prompt(entry, empty))
    forward = qwen_image21._forward_group
    monkeypatch.setattr(qwen_image21, "_forward_group", lambda transformer, latents, sigmas, cond, refs, length: (
        fed.extend(cond["prompt_embeds"][:, :length]) or forward(transformer, latents, sigmas, cond, refs, length)))
    assert train.run(cfg).steps == 4
    assert {row for row, _ in swapped} == {0, 1, 2} and len(swapped) == len(fed) >= 4  # every sample dropped
    for row, empty in swapped:
        expected = own.get(row, shared)
        assert all(torch.equal(empty[k], expected[k]) for k in expected), row
    used = [[torch.equal(embeds, p["prompt_embeds"]) for p in (own[0], own[1], shared)] for embeds in fed]
    assert all(sum(match) == 1 for match in used) and all(map(any, zip(*used)))  # each fed prompt is one of the three


def test_a_cache_encoded_without_dropout_is_refused_before_training_and_completed_by_preprocess(run, tmp_path):
    """caption_dropout turned on after stage 1: training stops before its first step, one line naming
    preprocess (exit code 2); preprocess then encodes only the edit rows' empty prompts."""
    from diffsynth_core.errors import exit_code_of
    from stages.status import work_left

    _, _, _, config = run
    paths = [f"cache.url={tmp_path / 'cache.zarr'}", f"output.path={tmp_path / 'out'}"]
    preprocess.run(config(*paths))
    cfg = config(*paths, "train.caption_dropout=0.3")
    with pytest.raises(Exception) as refused:
        train.run(cfg)
    message = str(refused.value)
    assert exit_code_of(refused.value) == 2 and "\n" not in message
    assert "train.caption_dropout" in message and "2 rows" in message and "splitflow preprocess" in message
    assert not (cfg.output_dir / "metrics.csv").exists() and not (cfg.output_dir / "checkpoints").exists()
    assert work_left(cfg).parts == [0]  # what `splitflow status` and `run` read: part 0 holds those rows
    summary = preprocess.run(cfg)
    assert (summary.encoded, summary.reused, summary.empty_prompts, summary.complete) == (0, 3, 2, True)
    assert work_left(cfg).parts == []
    assert "2 empty prompts" in summary.describe()


def test_a_musubi_toml_with_control_directory_gives_rgba_controls_in_order(tmp_path):
    """musubi-tuner's Qwen-Image-2.1 dataset: same-stem controls (name_0, name_1) in their order, at multiples
    of 32, RGBA for the VAE (RGB files opaque) and the same pixels over white for the vision tower."""
    from stages.config import build_config
    from stages.datasets import open_dataset

    images, controls = tmp_path / "images", tmp_path / "controls"
    images.mkdir(), controls.mkdir()
    _image(images / "cat.png", "RGB", (96, 64), "red")
    (images / "cat.txt").write_text("put the cat on the sofa")
    _image(controls / "cat_1.png", "RGB", (64, 64), "blue")
    _image(controls / "cat_0.png", "RGBA", (96, 64), (0, 200, 0, 100))
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [96, 64]\nenable_bucket = true\n[[datasets]]\n'
                    f'image_directory = "{images}"\ncontrol_directory = "{controls}"\ncontrol_resolution = [64, 64]\n')
    cfg = build_config({"dataset": {"metadata_path": str(toml)}, "model": {"family": "qwen_image21"}})
    sample = open_dataset(cfg.dataset, SPEC).load(0)
    assert [p.name for p in sample.files] == ["cat.png", "cat_0.png", "cat_1.png"]
    assert sample.pixels.shape[0] == 4 and [r.shape[0] for r in sample.references] == [4, 4]
    assert sample.references[0][3].min() < 0 and torch.equal(sample.references[1][3], torch.ones(1, 64, 64))
    for reference, image in zip(sample.references, sample.reference_images):
        assert (image.height, image.width) == tuple(reference.shape[-2:]) and reference.shape[-1] % 32 == 0
