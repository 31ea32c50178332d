"""Rows that used to be silently wrong or unclear: unquoted commas, special files, paths out of the
dataset folder, transparency, animated files for image-only families."""

from __future__ import annotations

import os

import pytest
import torch
from PIL import Image

from diffsynth_core.data import DatasetError, SampleDataset, load_metadata
from splitflow_media_files import write_gif, write_image, write_metadata, write_mp4


def _dataset(folder, rows, **kwargs) -> SampleDataset:
    return SampleDataset(write_metadata(folder / "m.csv", rows), folder, **kwargs)


# -- CSV ------------------------------------------------------------------------------------
def test_an_unquoted_comma_in_a_prompt_is_an_error_naming_the_row(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text('image,prompt\na.png,"a cat, sitting on a mat"\nb.png,a cat, sitting on a mat\n')
    with pytest.raises(DatasetError, match=r"m\.csv, data row 2 \(index 1\): line 3 has 3 cells but the header "
                                           r"has 2 columns \(image, prompt\): a cell holds an unquoted comma"):
        load_metadata(path)


def test_one_extra_cell_on_every_row_is_not_taken_as_an_index(tmp_path):
    # pandas took the first column as the index here and cut every prompt to " sitting on a mat".
    path = tmp_path / "m.csv"
    path.write_text("image,prompt\na.png,a cat, sitting on a mat\nb.png,a dog, lying\n")
    with pytest.raises(DatasetError, match=r"data row 1 \(index 0\): line 2 has 3 cells"):
        load_metadata(path)


def test_quoted_commas_trailing_separators_and_short_rows_are_fine(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text('image,prompt,video,\r\na.png,"a cat, sitting\non a mat",,\r\n\r\nb.png,plain\r\n')
    assert load_metadata(path) == [{"image": "a.png", "prompt": "a cat, sitting\non a mat", "video": None},
                                   {"image": "b.png", "prompt": "plain", "video": None}]


def test_a_repeated_column_name_is_an_error(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("image,prompt,prompt\na.png,x,y\n")
    with pytest.raises(DatasetError, match=r"column\(s\) \['prompt'\] appear twice"):
        load_metadata(path)


# -- files that are not regular files ---------------------------------------------------------
@pytest.mark.parametrize("make, expected", [
    (lambda p: os.symlink("/dev/zero", p), r"is a character device \(symlink to /dev/zero\), not a regular file"),
    (lambda p: p.mkdir(), "is a folder, not a media file"),
    (lambda p: os.mkfifo(p), r"is a named pipe \(FIFO\), not a regular file"),
    (lambda p: os.symlink(p.parent / "gone.png", p), r"file not found \(symlink to .*gone.png\)"),
])
def test_special_files_get_a_clear_line_and_are_never_opened(tmp_path, make, expected):
    make(tmp_path / "x.png")
    ds = _dataset(tmp_path, [{"image": "x.png", "prompt": "p"}], allow_external_paths=True)
    with pytest.raises(DatasetError, match=rf"data row 1 \(index 0\), file .*x\.png: column 'image': {expected}"):
        ds.source_files(0)  # what preprocessing calls first (it hashes the file: a FIFO would block)
    skipping = _dataset(tmp_path, [{"image": "x.png", "prompt": "p"}], skip_bad_samples=True,
                        allow_external_paths=True)
    assert skipping.load(0) is None and skipping.skipped[0][0] == 0


# -- paths out of the dataset folder ----------------------------------------------------------
def test_media_must_resolve_inside_the_dataset_folder(tmp_path):
    data = tmp_path / "data"
    write_image(data / "in.png", 16, 16)
    write_image(tmp_path / "secret.png", 16, 16)
    os.symlink(tmp_path / "secret.png", data / "link.png")
    rows = [{"image": "in.png", "prompt": "p"}, {"image": "../secret.png", "prompt": "p"},
            {"image": str(tmp_path / "secret.png"), "prompt": "p"}, {"image": "link.png", "prompt": "p"}]
    ds = _dataset(data, rows)
    assert ds.load(0) is not None
    for row in (1, 2, 3):
        with pytest.raises(DatasetError, match=rf"data row {row + 1} .*resolves to {tmp_path / 'secret.png'}, "
                                               rf"outside the dataset folder {data}.*allow_external_paths = true"):
            ds.load(row)
    allowed = _dataset(data, rows, allow_external_paths=True)
    assert all(allowed.load(row) is not None for row in range(4))


# -- transparency ---------------------------------------------------------------------------
def _rgba(path, alpha: int):
    Image.new("RGBA", (16, 16), (0, 200, 0, alpha)).save(path)  # green hidden under the alpha


def _colour(sample) -> list[int]:
    return ((sample.pixels[:, 0, 8, 8] + 1) * 127.5).round().int().tolist()


def test_transparent_pixels_are_composited_on_the_background(tmp_path):
    _rgba(tmp_path / "clear.png", 0)
    _rgba(tmp_path / "half.png", 128)
    rows = [{"image": "clear.png", "prompt": "p"}, {"image": "half.png", "prompt": "p"}]
    white = _dataset(tmp_path, rows)
    assert _colour(white.load(0)) == [255, 255, 255]  # was the hidden green
    assert _colour(white.load(1)) == [127, 227, 127]  # 50 % green over white
    black = _dataset(tmp_path, rows, background="black")
    assert _colour(black.load(0)) == [0, 0, 0] and _colour(black.load(1)) == [0, 100, 0]
    with pytest.raises(DatasetError, match="'nope' is not a colour"):
        _dataset(tmp_path, rows, background="nope")


def test_palette_transparency_in_gif_frames_is_composited_too(tmp_path):
    frame = Image.new("P", (16, 16), 1)
    frame.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    frame.save(tmp_path / "t.gif", transparency=1)
    sample = _dataset(tmp_path, [{"video": "t.gif", "prompt": "p"}], num_frames=1, background="#ff0000").load(0)
    assert _colour(sample) == [255, 0, 0]


def test_the_background_keys_only_images_with_transparency(tmp_path):
    _rgba(tmp_path / "clear.png", 0)
    write_image(tmp_path / "opaque.png", 16, 16)
    rows = [{"image": "clear.png", "prompt": "p"}, {"image": "opaque.png", "prompt": "p"}]
    white, black = _dataset(tmp_path, rows), _dataset(tmp_path, rows, background="black")
    assert white.key_settings(0) != black.key_settings(0)
    assert white.key_settings(1) == black.key_settings(1)  # opaque images keep their cache entries


# -- animated files for families that train on stills ------------------------------------------
def test_an_image_only_family_refuses_videos_naming_row_and_file(tmp_path):
    write_gif(tmp_path / "clip.gif", 5)
    write_gif(tmp_path / "still.gif", 1)
    write_mp4(tmp_path / "clip.mp4", 2)
    rows = [{"video": "clip.gif", "prompt": "p"}, {"image": "clip.mp4", "prompt": "p"},
            {"image": "still.gif", "prompt": "p"}]
    ds = _dataset(tmp_path, rows, num_frames=5, stills_only=True)
    for row, name in ((0, "clip.gif"), (1, "clip.mp4")):
        with pytest.raises(DatasetError, match=rf"data row {row + 1} .*file .*{name}: column '\w+': a video or "
                                               rf"animated GIF, but this model family trains on still images"):
            ds.source_files(row)
    assert ds.load(2).pixels.shape[1] == 1  # a one-frame GIF is a still image
    skipping = _dataset(tmp_path, rows, num_frames=5, stills_only=True, skip_bad_samples=True)
    assert [skipping.load(row) is None for row in range(3)] == [True, True, False]
    assert [row for row, _, _ in skipping.skipped] == [0, 1]
    video_family = _dataset(tmp_path, rows, num_frames=5, frame_multiple=4)
    assert torch.is_tensor(video_family.load(0).pixels)
