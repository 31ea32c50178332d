"""kohya / musubi-tuner datasets used as they are: caption folders, musubi JSONL, the musubi TOML.

The musubi names and defaults come from musubi-tuner's src/musubi_tuner/dataset/config_utils.py
and datasources.py (see stages/compat/musubi.py, kohya.py).
"""

from __future__ import annotations

import json
import logging

import pytest
from PIL import Image

from diffsynth_core.errors import InputError
from stages import preprocess, train
from stages.compat.musubi import read_dataset_config
from stages.config import build_config
from stages.keys import training_keys


def _image(path, size=(64, 48), colour=(200, 30, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def _config(demo_assets, tmp_path, dataset, *extra):
    data = {"dataset": dataset, "model": {"family": "qwen_image", "path": str(demo_assets / "model"),
                                          "dtype": "float32"},
            "cache": {"url": str(tmp_path / "cache.zarr")}, "preprocess": {"device": "cpu"},
            "train": {"max_steps": 2, "lora_rank": 4, "device": "cpu", "save_steps": 0},
            "output": {"path": str(tmp_path / "out"), "export_every": "end"}}
    return build_config(data, list(extra))


def _prompts_in_training_order(cfg):
    store, keys = training_keys(cfg)  # what stage 2 trains on, derived from the config
    return [store.get(k)["meta"]["prompt"] for k in keys]


def test_a_kohya_caption_folder_trains_as_it_is(demo_assets, tmp_path, caplog):
    folder = tmp_path / "imgs"
    for name, caption in (("a.png", "a red square"), ("b.JPG", "a blue square"), ("c.webp", None)):
        _image(folder / name)
        if caption:
            (folder / name).with_suffix(".txt").write_text(caption + "\n")
    (folder / "notes.md").write_text("not media")
    cfg = _config(demo_assets, tmp_path, {"metadata_path": str(folder)})
    with caplog.at_level(logging.WARNING):
        summary = preprocess.run(cfg)
    assert summary.complete and summary.encoded == 2
    assert "1 images without a .txt caption left out" in caplog.text and "c.webp" in caplog.text
    assert _prompts_in_training_order(cfg) == ["a red square", "a blue square"]
    assert train.run(cfg).steps == 2


def test_kohya_repeat_folders_repeat_and_caption_with_their_class_tokens(demo_assets, tmp_path):
    root = tmp_path / "train"
    _image(root / "3_sks dog" / "x.png")
    (root / "3_sks dog" / "x.caption").write_text("sks dog on grass")
    _image(root / "3_sks dog" / "y.png", colour=(0, 90, 0))  # no caption file: the class tokens
    _image(root / "3_sks dog" / "w.png", colour=(90, 0, 0))
    (root / "3_sks dog" / "w.caption").write_text("sks dog asleep")
    _image(root / "1_cat" / "z.png", colour=(0, 0, 90))
    (root / "1_cat" / "z.caption").write_text("a cat")
    cfg = _config(demo_assets, tmp_path, {"metadata_path": str(root), "caption_extension": ".caption"},
                  "preprocess.parts=2")
    part_keys = [set(preprocess.make_plan(cfg, part).keys.values()) for part in (0, 1)]
    assert not part_keys[0] & part_keys[1]  # a row and its repeats are one entry, for one part to encode
    assert sum(preprocess.run(cfg, part).encoded for part in (0, 1)) == 4
    assert preprocess.finalize(cfg).complete
    assert _prompts_in_training_order(cfg) == ["a cat"] + ["sks dog asleep", "sks dog on grass", "sks dog"] * 3


def test_dataset_repeat_multiplies_a_folders_own_repeats_once(demo_assets, tmp_path):
    from stages.status import work_left
    root = tmp_path / "train"
    _image(root / "2_cat" / "z.png")
    (root / "2_cat" / "z.caption").write_text("a cat")
    cfg = _config(demo_assets, tmp_path, {"metadata_path": str(root), "caption_extension": ".caption", "repeat": 3},
                  "train.num_epochs=1", "train.batch_size=1")
    cfg.train.max_steps = None  # an epoch of steps: one row, twice by its folder, three times by dataset.repeat
    preprocess.run(cfg, 0)
    assert preprocess.finalize(cfg).complete
    assert work_left(cfg).total_steps == 2 * 3


MUSUBI_TOML = """
[general]
resolution = [64, 48]
caption_extension = ".caption"
batch_size = 2
enable_bucket = true
bucket_no_upscale = false

[[datasets]]
image_directory = "{folder}"
cache_directory = "/somewhere/else"
num_repeats = 2

[[datasets]]
image_jsonl_file = "{jsonl}"
resolution = 32
enable_bucket = false
"""


def _musubi_dataset(tmp_path):
    folder, jsonl = tmp_path / "musubi_imgs", tmp_path / "meta.jsonl"
    _image(folder / "one.png", size=(128, 64))
    (folder / "one.caption").write_text("one wide image")
    _image(tmp_path / "elsewhere" / "two.png", size=(80, 80), colour=(1, 2, 3))
    jsonl.write_text(json.dumps({"image_path": str(tmp_path / "elsewhere" / "two.png"), "caption": "two"}) + "\n")
    toml = tmp_path / "dataset.toml"
    toml.write_text(MUSUBI_TOML.format(folder=folder, jsonl=jsonl))
    return toml, folder, jsonl


def test_a_musubi_dataset_toml_maps_each_dataset_to_a_source_and_trains(demo_assets, tmp_path, caplog):
    toml, folder, jsonl = _musubi_dataset(tmp_path)
    with caplog.at_level(logging.WARNING):
        cfg = _config(demo_assets, tmp_path, {"metadata_path": str(toml)})
    assert [s.model_dump(exclude_none=True) for s in cfg.dataset.sources] == [
        {"metadata_path": str(folder), "base_path": "", "repeat": 2, "caption_extension": ".caption",
         "max_pixels": 64 * 48, "reference_size": "target"},  # enable_bucket: area-based
        {"metadata_path": str(jsonl), "base_path": "", "repeat": 1, "caption_extension": ".caption",
         "height": 32, "width": 32, "reference_size": "target"}]  # no bucket: musubi's fixed resolution
    # (control images, none here, would be sized to the target's bucket, as musubi sizes them)
    assert cfg.train.batch_size == 2  # trained in batches of one latent shape (bucket)
    assert "datasets[0].cache_directory has no effect" in caplog.text

    preprocess.run(cfg)
    store, keys = training_keys(cfg)
    entries = [store.get(k) for k in keys]
    assert [(e["meta"]["prompt"], e["meta"]["height"], e["meta"]["width"]) for e in entries] == [
        ("one wide image", 32, 64), ("one wide image", 32, 64), ("two", 32, 32)]  # area <= 64*48, /16
    assert train.run(cfg).steps == 2

    saved = build_config(json.loads(json.dumps(cfg.model_dump(mode="json"))))
    assert saved.dataset.sources == cfg.dataset.sources  # a resolved config keeps its sources
    assert saved.dataset.metadata_path == str(toml)  # and the user's value


def test_musubi_jsonl_keys_work_as_metadata(demo_assets, tmp_path):
    _, _, jsonl = _musubi_dataset(tmp_path)
    cfg = _config(demo_assets, tmp_path, {"metadata_path": str(jsonl)})
    assert preprocess.run(cfg).encoded == 1
    assert _prompts_in_training_order(cfg) == ["two"]


def test_musubi_video_and_batch_settings_map(tmp_path):
    toml = tmp_path / "video.toml"
    toml.write_text('[general]\nbatch_size = 4\n[[datasets]]\nvideo_directory = "clips"\n'
                    'target_frames = [1, 25, 45]\nframe_extraction = "head"\nresolution = [960, 544]\n')
    sources, batch_size = read_dataset_config(toml)
    assert batch_size == 4
    assert [s["num_frames"] for s in sources] == [1, 25, 45]
    assert all(s["height"] == 544 and s["width"] == 960 and s["metadata_path"].endswith("/clips") for s in sources)
    cfg = build_config({"dataset": {"metadata_path": str(toml)}})
    assert cfg.train.batch_size == 4  # the config did not set it: the TOML decides
    assert build_config({"dataset": {"metadata_path": str(toml)}, "train": {"batch_size": 1}}).train.batch_size == 1


@pytest.mark.parametrize("body, message", [
    ('[[datasets]]\nimage_directory = "x"\nflip_aug = true\n', "datasets\\[0\\]: unknown key 'flip_aug'"),
    ('[[datasets]]\nvideo_directory = "x"\nframe_extraction = "chunk"\n', "frame_extraction: 'chunk' is not"),
    ('[[datasets]]\nimage_directory = "x"\ncontrol_resolution = [0, 8]\n', "control_resolution: expected"),
    ('[general]\nbatch_size = 1\n[[datasets]]\nimage_directory = "x"\n[[datasets]]\nimage_directory = "y"\n'
     'batch_size = 2\n', "batch_size: differs between datasets"),
    ('[[datasets]]\nimage_directory = "x"\nimage_jsonl_file = "y"\n', "give exactly one of"),
    ("[general\n", "cannot parse"),
])
def test_musubi_toml_mistakes_are_one_line_naming_the_key(tmp_path, body, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(body)
    with pytest.raises(InputError, match=message) as err:
        build_config({"dataset": {"metadata_path": str(toml)}})
    assert str(toml) in str(err.value) and "\n" not in str(err.value)


def test_a_caption_file_that_is_not_utf8_is_one_line_naming_it(demo_assets, tmp_path):
    folder = tmp_path / "imgs"
    _image(folder / "a.png")
    (folder / "a.txt").write_bytes("une légende".encode("latin-1"))  # saved by an editor in Latin-1
    cfg = _config(demo_assets, tmp_path, {"metadata_path": str(folder)})
    with pytest.raises(InputError) as caught:
        preprocess.run(cfg)
    assert "a.txt" in str(caught.value) and "UTF-8" in str(caught.value) and "\n" not in str(caught.value)
