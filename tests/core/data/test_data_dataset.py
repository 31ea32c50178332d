"""SampleDataset on real image files: pixels, sizes, formats, repeat, settings and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_core.data import DatasetError, Sample, SampleDataset
from splitflow_media_files import write_image, write_metadata


def _dataset(tmp_path: Path, rows: list[dict], suffix: str = ".csv", **kwargs) -> SampleDataset:
    return SampleDataset(write_metadata(tmp_path / f"metadata{suffix}", rows), **kwargs)


@pytest.mark.parametrize("ext", ["png", "jpg", "webp"])
def test_image_becomes_one_frame_in_minus_one_to_one(tmp_path, ext):
    write_image(tmp_path / f"red.{ext}", 40, 24, (255, 0, 0))
    ds = _dataset(tmp_path, [{"image": f"red.{ext}", "prompt": "a red square"}])
    sample = ds.load(0)
    assert isinstance(sample, Sample)
    assert sample.pixels.dtype == torch.float32 and sample.pixels.shape == (3, 1, 16, 32)
    assert (sample.height, sample.width, sample.num_frames) == (16, 32, 1)
    assert sample.files == [tmp_path / f"red.{ext}"] and sample.row == 0
    assert sample.fields == {"image": f"red.{ext}", "prompt": "a red square"}
    assert sample.prompt == "a red square"
    red, rest = sample.pixels[0], sample.pixels[1:]
    assert sample.pixels.min() >= -1 and sample.pixels.max() <= 1
    assert torch.allclose(red, torch.ones_like(red), atol=0.05)
    assert torch.allclose(rest, -torch.ones_like(rest), atol=0.05)


def test_png_pixels_are_exact(tmp_path):
    a = np.random.default_rng(0).integers(0, 256, size=(32, 48, 3), dtype=np.uint8)
    Image.fromarray(a).save(tmp_path / "noise.png")
    sample = _dataset(tmp_path, [{"image": "noise.png", "prompt": "noise"}]).load(0)
    expected = torch.from_numpy(a).permute(2, 0, 1)[:, None].float() / 127.5 - 1
    assert torch.equal(sample.pixels, expected)


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_csv_json_jsonl_give_the_same_samples(tmp_path, suffix):
    write_image(tmp_path / "img" / "a.png", 70, 50, (10, 200, 30))
    write_image(tmp_path / "img" / "b.jpg", 33, 90, (200, 10, 30))
    rows = [{"image": "img/a.png", "prompt": "a"}, {"image": "img/b.jpg", "prompt": "b"}]
    csv_ds, other = _dataset(tmp_path, rows), _dataset(tmp_path, rows, suffix)
    assert csv_ds.records == other.records
    for i in range(2):
        a, b = csv_ds.load(i), other.load(i)
        assert torch.equal(a.pixels, b.pixels) and a.fields == b.fields and a.files == b.files


def test_max_pixels_shrinks_and_never_upscales(tmp_path):
    write_image(tmp_path / "big.png", 400, 200)
    write_image(tmp_path / "small.png", 40, 20)
    rows = [{"image": "big.png", "prompt": "p"}, {"image": "small.png", "prompt": "p"}]
    ds = _dataset(tmp_path, rows, max_pixels=64 * 64)
    big, small = ds.load(0), ds.load(1)
    assert (big.height, big.width) == (32, 80)  # sqrt(4096/80000)*(200,400) = (45, 90) → ×16
    assert big.height * big.width <= 64 * 64
    assert (small.height, small.width) == (16, 32)


def test_fixed_size_crops_and_resizes_to_exactly_that(tmp_path):
    write_image(tmp_path / "wide.png", 100, 20)
    write_image(tmp_path / "tiny.png", 8, 8)
    rows = [{"image": "wide.png", "prompt": "p"}, {"image": "tiny.png", "prompt": "p"}]
    ds = _dataset(tmp_path, rows, height=32, width=48)
    assert ds.load(0).pixels.shape == (3, 1, 32, 48)
    assert ds.load(1).pixels.shape == (3, 1, 32, 48)  # fixed size may upscale, by design


@pytest.mark.parametrize("kwargs, message", [
    ({"height": 520, "width": 512}, "height=520 must be a multiple of 16"),
    ({"height": 512, "width": 100}, "width=100 must be a multiple of 16"),
    ({"height": 512}, "give both height and width or neither"),
    ({"repeat": 0}, "repeat must be a positive integer"),
    ({"max_pixels": 100}, "max_pixels=100 is below division"),
    ({"num_frames": 80, "frame_multiple": 4},
     r"num_frames=80 must be ≡ 1 \(mod frame_multiple=4\), e.g. 77"),
])
def test_invalid_settings_fail_at_construction(tmp_path, kwargs, message):
    # The media file does not exist: settings are checked before anything is read.
    with pytest.raises(DatasetError, match=message):
        _dataset(tmp_path, [{"image": "missing.png", "prompt": "p"}], **kwargs)


def test_invalid_settings_are_all_reported_at_once(tmp_path):
    with pytest.raises(DatasetError) as info:
        _dataset(tmp_path, [{"image": "x.png", "prompt": "p"}], height=20, width=30, repeat=-1)
    assert all(s in str(info.value) for s in ("height=20", "width=30", "repeat"))


@pytest.mark.parametrize("rows, message", [
    ([{"image": "a.png", "description": "p"}], r"no prompt column \(expected one of prompt, caption, text\)"),
    ([{"file": "a.png", "prompt": "p"}], r"none of the data_file_keys columns \(image, video\)"),
])
def test_missing_columns_fail_at_construction_naming_the_file(tmp_path, rows, message):
    with pytest.raises(DatasetError, match=message) as info:
        _dataset(tmp_path, rows)
    assert str(tmp_path / "metadata.csv") in str(info.value)


def test_caption_column_is_accepted_as_prompt(tmp_path):
    write_image(tmp_path / "a.png", 16, 16)
    sample = _dataset(tmp_path, [{"image": "a.png", "caption": "from a captioner"}]).load(0)
    assert sample.prompt == "from a captioner"
    assert sample.fields["caption"] == "from a captioner"


def test_base_path_and_absolute_paths(tmp_path):
    write_image(tmp_path / "media" / "a.png", 16, 16)
    write_image(tmp_path / "abs.png", 16, 16)
    rows = [{"image": "a.png", "prompt": "p"}, {"image": str(tmp_path / "abs.png"), "prompt": "p"}]
    metadata = write_metadata(tmp_path / "meta" / "m.jsonl", rows)
    ds = SampleDataset(metadata, tmp_path / "media")
    assert ds.source_files(0) == [tmp_path / "media" / "a.png"]
    with pytest.raises(DatasetError, match="outside the dataset folder .*allow_external_paths"):
        ds.source_files(1)  # outside base_path: refused unless allowed
    ds = SampleDataset(metadata, tmp_path / "media", allow_external_paths=True)
    assert ds.source_files(1) == [tmp_path / "abs.png"]


def test_repeat_and_torch_dataset_protocol(tmp_path):
    for i in range(3):
        write_image(tmp_path / f"{i}.png", 16 + 16 * i, 16, (80 * i, 0, 0))
    ds = _dataset(tmp_path, [{"image": f"{i}.png", "prompt": str(i)} for i in range(3)], repeat=2)
    assert len(ds.records) == 3 and len(ds) == 6
    for i in range(len(ds)):
        assert ds[i].row == i % 3 and torch.equal(ds[i].pixels, ds.load(i % 3).pixels)
    assert ds[-1].row == 2
    with pytest.raises(IndexError):
        ds[6]
    loader = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=lambda batch: batch[0])
    assert [s.prompt for s in loader] == ["0", "1", "2"] * 2


def test_settings_hold_what_changes_the_pixels(tmp_path):
    rows = [{"image": "a.png", "prompt": "p"}]
    settings = _dataset(tmp_path, rows).settings()
    assert {k: settings[k] for k in ("height", "width", "max_pixels", "num_frames", "frame_multiple",
                                     "division", "data_file_keys")} == {
        "height": None, "width": None, "max_pixels": 1024 * 1024, "num_frames": 1,
        "frame_multiple": 1, "division": 16, "data_file_keys": ["image", "video"]}
    assert _dataset(tmp_path, rows, max_pixels=512 * 512).settings() != settings
    assert _dataset(tmp_path, rows, repeat=3).settings() == settings  # repeat changes no pixels
    assert _dataset(tmp_path, rows, data_file_keys="image,video").settings() == settings


def test_source_files_do_not_decode(tmp_path):
    (tmp_path / "corrupt.png").write_bytes(b"not a png at all")
    ds = _dataset(tmp_path, [{"image": "corrupt.png", "prompt": "p"}])
    assert ds.source_files(0) == [tmp_path / "corrupt.png"]


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (48, 16), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display": a portrait photo stored landscape
    image.save(tmp_path / "phone.jpg", exif=exif)
    sample = _dataset(tmp_path, [{"image": "phone.jpg", "prompt": "p"}]).load(0)
    assert (sample.height, sample.width) == (48, 16)


def test_sixteen_bit_greyscale_png_is_scaled_not_clipped(tmp_path):
    wide = (np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64)
    Image.fromarray(wide).save(tmp_path / "depth.png")
    sample = _dataset(tmp_path, [{"image": "depth.png", "prompt": "p"}]).load(0)
    expected = torch.from_numpy((wide >> 8).astype(np.float32)) / 127.5 - 1
    for channel in range(3):
        assert torch.equal(sample.pixels[channel, 0], expected)


@pytest.mark.parametrize("mode, color, rgb", [("L", 128, (128,) * 3), ("RGBA", (0, 255, 0, 0), (255, 255, 255)),
                                              ("P", 0, (0, 0, 0)), ("CMYK", (0, 255, 0, 0), (255, 0, 255))])
def test_other_modes_become_rgb(tmp_path, mode, color, rgb):
    name = "x.jpg" if mode == "CMYK" else "x.png"
    Image.new(mode, (16, 16), color).save(tmp_path / name)
    pixels = _dataset(tmp_path, [{"image": name, "prompt": "p"}]).load(0).pixels
    got = ((pixels[:, 0, 8, 8] + 1) * 127.5).round().tolist()
    assert all(abs(g - w) <= 2 for g, w in zip(got, rgb))


def test_max_pixels_does_not_enter_settings_at_a_fixed_size(tmp_path):
    rows = [{"image": "a.png", "prompt": "p"}]
    fixed = _dataset(tmp_path, rows, height=64, width=64).settings()
    assert fixed["max_pixels"] is None
    assert _dataset(tmp_path, rows, height=64, width=64, max_pixels=128 * 128).settings() == fixed
