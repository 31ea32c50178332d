"""Reference images through both stages on tiny models: a Qwen-Image cache, then an Edit-2509 config over
the same images (targets reused, prompts and references encoded), the entries stage 1 writes, batches by
reference shapes, and a SIGKILL + resume with references, bit for bit."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cache_store import open_cache
from diffsynth_core.models import get_family
from diffsynth_core.training.metrics import read_metrics
from stages import preprocess, train
from stages.datasets import open_dataset
from stages.demo import demo_config
from stages.keys import make_plan, training_set
from stages.train import CachedSamples

from .sigkill import train_until_first_checkpoint

SMALL_REFERENCES = "dataset.reference_pixels=4096"  # 64x64 references: the tiny VAE stays fast on CPU


@pytest.fixture(scope="module")
def edit_setup(demo_assets, tmp_path_factory):
    """Four demo images; a text-to-image metadata file and an edit one over the same targets (rows 0-2 name
    references, row 3 none); a tiny Edit-2509 model whose VAE is the text-to-image model's (as DiffSynth's
    scripts load Qwen/Qwen-Image's VAE beside the edit DiT)."""
    root = tmp_path_factory.mktemp("references")
    dataset = root / "dataset"
    shutil.copytree(demo_assets / "dataset", dataset)
    with open(dataset / "metadata.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))[:4]
    _write(dataset / "t2i.csv", rows)
    edits = [{"image": row["image"], "prompt": f"turn it into {row['prompt']}",
              "edit_image": json.dumps([rows[(i + 1) % 4]["image"]] + ([rows[(i + 2) % 4]["image"]] if i == 1 else []))
              if i < 3 else ""} for i, row in enumerate(rows)]
    _write(dataset / "edit.csv", edits)
    model = get_family("qwen_image", "edit-2509").save_tiny_model(root / "edit-model", 0)
    shutil.rmtree(model / "vae")
    shutil.copytree(demo_assets / "model" / "vae", model / "vae")

    def build(name: str, metadata: str, *overrides: str, model_path=model):
        base = [f"dataset.base_path={dataset}", f"dataset.metadata_path={dataset / metadata}",
                f"model.path={model_path}", f"cache.url={root / 'cache.zarr'}", "preprocess.parts=1",
                f"output.path={root / name}"]
        return demo_config(root, overrides=[*base, *overrides])

    return root, build, demo_assets / "model"


def _write(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_an_edit_config_reuses_the_text_to_image_targets_and_encodes_its_prompts_and_references(edit_setup):
    root, build, t2i_model = edit_setup
    t2i = build("t2i", "t2i.csv", model_path=t2i_model)
    first = preprocess.run(t2i)
    assert (first.encoded, first.latents_encoded) == (4, 4)

    edit = build("edit", "edit.csv", "model.variant='edit-2509'", SMALL_REFERENCES,
                 "dataset.data_file_keys=['image','edit_image']")
    second = preprocess.run(edit)
    assert (second.encoded, second.reused, second.latents_encoded, second.latents_reused) == (4, 0, 0, 4)
    assert "target latents: 0 encoded, 4 reused" in second.describe()
    assert preprocess.run(edit).encoded == 0  # and a re-run encodes nothing

    # What stage 1 wrote: reference latents at their own sizes, counted in meta; prompts encoded with the images.
    plan, spec = make_plan(edit), get_family("qwen_image", "edit-2509")
    store = open_cache(edit.cache_url, mode="r")
    counts = [len(json.loads(row["edit_image"])) if row["edit_image"] else 0 for row in plan.dataset.records]
    assert counts == [1, 2, 1, 0]
    components = spec.load_encoders(root / "edit-model", torch.float32)
    for row, count in enumerate(counts):
        entry = store.get(plan.keys[row])
        assert entry.get("meta", {}).get("references", 0) == count
        assert "latents" not in entry and store.has(plan.latent_keys[row])
        sample = plan.dataset.load(row)
        for i in range(count):
            expected = spec.encode_pixels(components, sample.references[i], "cpu")["latents"]
            torch.testing.assert_close(entry[f"ref_latents_{i}"], expected, rtol=1e-5, atol=1e-5)
            assert entry["meta"]["reference_shapes"][i] == list(expected.shape)
        [with_images] = spec.encode_prompts(components, [sample.prompt], "cpu", images=[sample.reference_images])
        torch.testing.assert_close(entry["prompt_embeds"], with_images["prompt_embeds"], rtol=1e-5, atol=1e-5)
        if count:  # the vision tokens are in the embedding
            [text_only] = spec.encode_prompts(components, [sample.prompt], "cpu")
            assert entry["prompt_embeds"].shape[0] > text_only["prompt_embeds"].shape[0]
    # The two configs train on their own rows: the same target latents, their own conditioning.
    t2i_plan = make_plan(t2i)
    assert t2i_plan.latent_keys == plan.latent_keys and set(t2i_plan.keys.values()).isdisjoint(plan.keys.values())


def test_batches_group_one_target_shape_and_one_list_of_reference_shapes(edit_setup):
    _, build, t2i_model = edit_setup
    edit = build("buckets", "edit.csv", "model.variant='edit-2509'", SMALL_REFERENCES,
                 "dataset.data_file_keys=['image','edit_image']", "train.batch_size=1", "train.max_steps=4",
                 "train.save_steps=0")
    preprocess.run(edit)
    found = training_set(edit)
    samples = CachedSamples(found.store, found.keys, found.latents)
    buckets = [samples.latent_shape(i) for i in range(len(samples))]
    # from the manifests, equal to the tensors'; rows 0 and 2 have one reference, row 1 two, row 3 none
    for i, bucket in enumerate(buckets):
        entry = samples[i]
        refs = [tuple(entry[f"ref_latents_{k}"].shape) for k in range(entry["meta"].get("references", 0))]
        assert bucket == ((tuple(entry["latents"].shape), *refs) if refs else tuple(entry["latents"].shape))
    assert len(buckets[1]) == 3 and isinstance(buckets[3][0], int)  # target + two references; plain target
    assert buckets[0] == buckets[2] and len(set(buckets)) == 3  # one shape, one reference of one shape: shared
    train.run(edit)
    rows = read_metrics(edit.output_dir / "metrics.csv")
    assert any("+" in r["bucket"] for r in rows)  # target+references, e.g. 16x1x12x12+16x1x8x8


def test_a_sigkilled_edit_run_resumes_bit_for_bit(edit_setup, tmp_path):
    root, build, _ = edit_setup
    options = ["model.variant='edit-2509'", SMALL_REFERENCES, "dataset.data_file_keys=['image','edit_image']",
               "train.caption_dropout=0.3", "train.max_steps=8", "train.save_steps=2"]
    reference = build("resume-reference", "edit.csv", *options)
    preprocess.run(reference)
    train.run(reference)
    killed = build("resume-killed", "edit.csv", *options)
    args = [f"dataset.base_path={killed.dataset.base_path}", f"dataset.metadata_path={killed.dataset.metadata_path}",
            f"model.path={killed.model.path}", f"cache.url={killed.cache_url}", f"output.path={killed.output.path}",
            "preprocess.parts=1", *options]
    killed_at = train_until_first_checkpoint(root, args, killed.output_dir)
    assert 2 <= killed_at < 8, killed_at
    summary = train.run(killed)
    assert summary.resumed_from == killed_at and summary.steps == 8
    got, expected = (load_file(str(c.output_dir / "lora.safetensors")) for c in (killed, reference))
    assert got.keys() == expected.keys() and all(got[k].equal(expected[k]) for k in expected)


def test_a_dataset_with_references_is_refused_by_a_family_that_takes_none(edit_setup):
    from diffsynth_core.data import DatasetError

    _, build, t2i_model = edit_setup
    cfg = build("refused", "edit.csv", model_path=t2i_model)
    with pytest.raises(DatasetError, match="'edit_image' names reference images, but this model family takes none"):
        open_dataset(cfg.dataset, get_family("qwen_image"))


def test_a_musubi_toml_with_control_directory_gives_same_stem_controls_in_order(edit_setup, tmp_path):
    from stages.config import build_config

    root, _, _ = edit_setup
    images, controls = tmp_path / "images", tmp_path / "controls"
    images.mkdir(), controls.mkdir()
    source = sorted((root / "dataset").glob("*.png"))
    for name, file in (("cat", source[0]), ("cat_2", source[1])):
        shutil.copy(file, images / f"{name}.png")
        (images / f"{name}.txt").write_text(f"edit {name}")
    shutil.copy(source[2], controls / "cat_1.png")
    shutil.copy(source[3], controls / "cat_0.png")
    shutil.copy(source[1], controls / "cat_2.png")  # cat_2's own control: the longer name takes it first
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [128, 96]\nenable_bucket = true\n[[datasets]]\n'
                    f'image_directory = "{images}"\ncontrol_directory = "{controls}"\n'
                    f'control_resolution = [64, 64]\n')
    cfg = build_config({"dataset": {"metadata_path": str(toml)},
                        "model": {"family": "qwen_image", "variant": "edit-2509"}})
    [source_cfg] = cfg.dataset.sources
    assert (source_cfg.control_directory, source_cfg.reference_size, source_cfg.reference_pixels) == \
        (str(controls), "family", 64 * 64)
    dataset = open_dataset(cfg.dataset, get_family("qwen_image", "edit-2509"))
    by_prompt = {dataset.load(i).prompt: dataset.load(i) for i in range(len(dataset.records))}
    assert [p.name for p in by_prompt["edit cat"].files] == ["cat.png", "cat_0.png", "cat_1.png"]
    assert [p.name for p in by_prompt["edit cat_2"].files] == ["cat_2.png", "cat_2.png"]
    assert all(r.shape[-2] * r.shape[-1] <= 64 * 64 * 1.3 for r in by_prompt["edit cat"].references)


def test_diffsynth_edit_flags_map_to_the_reference_path():
    from stages.compat.diffsynth import run_config_from_cli
    from stages.config import ConfigError

    flags = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.json",
             "--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image", "--zero_cond_t",
             "--model_paths", "[]"]
    with pytest.raises(ConfigError, match="--extra_inputs control_video: splitflow caches reference images only"):
        run_config_from_cli(None, [], flags[:6] + ["--extra_inputs", "edit_image,control_video"], "run")
    from stages.compat.diffsynth import FLAGS, _check_extra_inputs, _check_refused, parse_flags

    parsed = parse_flags(flags[:-2])
    _check_refused(parsed)  # --extra_inputs edit_image and --zero_cond_t are no longer refused
    _check_extra_inputs(parsed)
    assert FLAGS["zero_cond_t"].key == "model.zero_cond_t"
