"""Reference images in the dataset: every column convention, mixed rows, order, sizes as diffusers' edit
pipelines compute them, and bad input named by row, column and file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_core.data import DatasetError, SampleDataset
from diffsynth_core.models.base import ReferenceRule

RULE = ReferenceRule(max_count=3, vae_area=64 * 64, vae_multiple=32, text_area=32 * 32, text_multiple=32)


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    for name, (w, h) in {"t.png": (64, 48), "a.png": (80, 40), "b.png": (40, 90), "c.png": (50, 50)}.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / name)
    return tmp_path


def _names(sample) -> list[str]:
    return [p.name for p in sample.files[1:]]


def test_diffsynth_edit_image_a_string_or_a_json_list_also_in_a_csv_cell_mixed_with_plain_rows(folder):
    (folder / "m.csv").write_text('image,edit_image,prompt\nt.png,a.png,v1\nt.png,"[""b.png"", ""a.png""]",plus\n'
                                  't.png,,plain\nt.png,[],empty list\n')
    ds = SampleDataset(folder / "m.csv", data_file_keys="image,edit_image", references=RULE)
    assert [_names(ds.load(i)) for i in range(4)] == [["a.png"], ["b.png", "a.png"], [], []]
    assert [len(ds.load(i).references) for i in range(4)] == [1, 2, 0, 0]
    assert ds.source_files(1)[1:] == [folder / "b.png", folder / "a.png"]  # hashed into the row's key
    (folder / "m.json").write_text(json.dumps([{"image": "t.png", "edit_image": ["c.png"], "prompt": "x"}]))
    assert _names(SampleDataset(folder / "m.json", references=RULE).load(0)) == ["c.png"]


def test_musubi_control_paths_in_index_order_and_a_diffusers_cond_image(folder):
    rows = [{"image": "t.png", "caption": "x", "control_path_10": "c.png", "control_path_2": "b.png",
             "control_path": "a.png"},
            {"image": "t.png", "caption": "y", "cond_image": "b.png"}]
    (folder / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ds = SampleDataset(folder / "m.jsonl", references=RULE)
    assert _names(ds.load(0)) == ["a.png", "b.png", "c.png"]  # control_path is control_path_0; 2 before 10
    assert _names(ds.load(1)) == ["b.png"]


def test_sizes_equal_the_edit_plus_pipelines_vae_and_condition_images(folder):
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    (folder / "m.csv").write_text("image,edit_image,prompt\nt.png,b.png,x\n")
    sample = SampleDataset(folder / "m.csv", references=RULE).load(0)
    processor = VaeImageProcessor(vae_scale_factor=16)  # as QwenImageEditPlusPipeline builds it
    image = Image.open(folder / "b.png").convert("RGB")
    vae_w, vae_h = calculate_dimensions(RULE.vae_area, image.width / image.height)
    expected = processor.preprocess(image, vae_h, vae_w).unsqueeze(2)[0]
    assert sample.references[0].shape == expected.shape == (3, 1, vae_h, vae_w)
    torch.testing.assert_close(sample.references[0], expected, rtol=0, atol=1e-6)
    cond_w, cond_h = calculate_dimensions(RULE.text_area, image.width / image.height)
    condition = processor.resize(image, cond_h, cond_w)
    assert np.array_equal(np.asarray(sample.reference_images[0]), np.asarray(condition))


def test_reference_size_target_and_own_as_musubi_sizes_controls(folder):
    (folder / "m.csv").write_text("image,edit_image,prompt\nt.png,b.png,x\n")
    target = SampleDataset(folder / "m.csv", references=RULE, reference_size="target").load(0)
    assert target.references[0].shape[-2:] == target.pixels.shape[-2:] == (48, 64)
    own = SampleDataset(folder / "m.csv", references=RULE, reference_size="own").load(0)
    assert own.references[0].shape[-2:] == (64, 32)  # 90x40 floored to multiples of 32
    capped = SampleDataset(folder / "m.csv", references=RULE, reference_size="own", reference_pixels=32 * 32)
    assert capped.load(0).references[0].shape[-2:] == (64, 32)  # over 32² pixels: fitted to about that area
    with pytest.raises(DatasetError, match=r"row 1 .*file .*b\.png.*larger than any bucket"):
        SampleDataset(folder / "m.csv", references=RULE, reference_size="own", max_pixels=1024).load(0)


@pytest.mark.parametrize("cell, message", [
    ('"[""a.png"", ""b.png"""', "not a valid JSON list"),
    ('"[""a.png"", ""b.png"", ""c.png"", ""a.png""]"', "4 reference images, more than this model takes \\(3\\)"),
    ("gone.png", "column 'edit_image': file not found"),
])
def test_bad_references_are_one_line_naming_row_and_column_and_skippable(folder, cell, message):
    (folder / "m.csv").write_text(f"image,edit_image,prompt\nt.png,a.png,good\nt.png,{cell},bad\n")
    with pytest.raises(DatasetError, match=message) as err:
        SampleDataset(folder / "m.csv", references=RULE).load(1)
    assert "data row 2" in str(err.value) and "\n" not in str(err.value)
    skipping = SampleDataset(folder / "m.csv", references=RULE, skip_bad_samples=True)
    assert skipping.load(0) is not None and skipping.load(1) is None and skipping.skipped[0][0] == 1


def test_an_undecodable_reference_names_its_file(folder):
    (folder / "broken.png").write_bytes(b"not a png")
    (folder / "m.csv").write_text("image,edit_image,prompt\nt.png,broken.png,x\n")
    with pytest.raises(DatasetError, match=r"column 'edit_image': cannot decode image") as err:
        SampleDataset(folder / "m.csv", references=RULE).load(0)
    assert err.value.file.endswith("broken.png")


def test_references_given_to_a_family_that_takes_none_are_refused_at_once(folder):
    (folder / "m.csv").write_text("image,edit_image,prompt\nt.png,,plain\nt.png,a.png,x\n")
    with pytest.raises(DatasetError, match="data row 2 .*takes none"):
        SampleDataset(folder / "m.csv", data_file_keys="image,edit_image")
