"""Videos (GIF via Pillow, mp4 via imageio-ffmpeg): first num_frames frames, 4k+1 rule,
stills in a video column, corrupt and empty videos."""

from __future__ import annotations

import pytest
import torch

from diffsynth_core.data import DatasetError, SampleDataset, usable_frame_count
from diffsynth_core.data.media import MediaError
from splitflow_media_files import PALETTE, write_gif, write_image, write_metadata, write_mp4


def _video_dataset(tmp_path, name, **kwargs):
    return SampleDataset(write_metadata(tmp_path / "m.csv", [{"video": name, "prompt": "p"}]),
                         data_file_keys=("video",), **kwargs)


def _frame_colors(pixels: torch.Tensor) -> list[tuple[int, ...]]:
    """Mean colour of each frame, back in 0..255."""
    means = (pixels.mean(dim=(2, 3)) + 1) * 127.5  # (C, F)
    return [tuple(int(round(v)) for v in means[:, f].tolist()) for f in range(pixels.shape[1])]


@pytest.mark.parametrize("available, multiple, expected", [
    (1, 1, 1), (7, 1, 7), (81, 4, 81), (80, 4, 77), (5, 4, 5), (4, 4, 1), (9, 4, 9), (12, 8, 9),
])
def test_usable_frame_count_is_largest_n_congruent_to_one(available, multiple, expected):
    assert usable_frame_count(available, multiple) == expected


def test_usable_frame_count_of_nothing_is_an_error():
    with pytest.raises(MediaError, match="no frames"):
        usable_frame_count(0, 4)


def test_gif_gives_its_first_num_frames_in_order(tmp_path):
    write_gif(tmp_path / "clip.gif", 7)
    sample = _video_dataset(tmp_path, "clip.gif", num_frames=5).load(0)
    assert sample.pixels.shape == (3, 5, 32, 48) and sample.num_frames == 5
    assert _frame_colors(sample.pixels) == PALETTE[:5]


@pytest.mark.parametrize("available, num_frames, expected", [(7, 5, 5), (9, 9, 9), (12, 9, 9)])
def test_gif_gives_num_frames_when_it_has_them(tmp_path, available, num_frames, expected):
    write_gif(tmp_path / "clip.gif", available)
    sample = _video_dataset(tmp_path, "clip.gif", num_frames=num_frames, frame_multiple=4).load(0)
    assert sample.num_frames == expected and sample.pixels.shape[1] == expected
    assert _frame_colors(sample.pixels) == PALETTE[:expected]


@pytest.mark.parametrize("available, num_frames", [(7, 9), (3, 9), (1, 5)])
def test_a_video_shorter_than_num_frames_is_an_error_naming_row_and_file(tmp_path, available, num_frames):
    # It used to become a 4k+1-frame clip or silently a still image (3 of 9 frames -> 1).
    write_gif(tmp_path / "clip.gif", available)
    ds = _video_dataset(tmp_path, "clip.gif", num_frames=num_frames, frame_multiple=4)
    with pytest.raises(DatasetError, match=rf"data row 1 \(index 0\), file .*clip.gif: column 'video': the "
                                           rf"video has {available} frames, fewer than dataset.num_frames = "
                                           rf"{num_frames}"):
        ds.load(0)
    skipping = _video_dataset(tmp_path, "clip.gif", num_frames=num_frames, frame_multiple=4, skip_bad_samples=True)
    assert skipping.load(0) is None and skipping.skipped[0][:2] == (0, str(tmp_path / "clip.gif"))


def test_video_frames_are_cropped_and_resized_like_images(tmp_path):
    write_gif(tmp_path / "clip.gif", 3, width=48, height=32)
    ds = _video_dataset(tmp_path, "clip.gif", num_frames=3, height=16, width=16)
    assert ds.load(0).pixels.shape == (3, 3, 16, 16)
    ds = _video_dataset(tmp_path, "clip.gif", num_frames=3, max_pixels=24 * 16)
    assert ds.load(0).pixels.shape == (3, 3, 16, 16)  # (32, 48) * 0.5 = (16, 24) → floored


def test_still_image_in_video_column_is_one_frame(tmp_path):
    write_image(tmp_path / "still.png", 32, 32)
    sample = _video_dataset(tmp_path, "still.png", num_frames=81, frame_multiple=4).load(0)
    assert sample.pixels.shape == (3, 1, 32, 32)


def test_gif_in_image_column_is_its_first_frame(tmp_path):
    write_gif(tmp_path / "clip.gif", 4)
    ds = SampleDataset(write_metadata(tmp_path / "m.csv", [{"image": "clip.gif", "prompt": "p"}]),
                       num_frames=5)
    sample = ds.load(0)
    assert sample.pixels.shape == (3, 1, 32, 48) and _frame_colors(sample.pixels) == PALETTE[:1]


def test_mixed_image_and_video_rows(tmp_path):
    write_image(tmp_path / "a.png", 48, 32)
    write_gif(tmp_path / "b.gif", 6)
    ds = SampleDataset(write_metadata(tmp_path / "m.jsonl", [
        {"image": "a.png", "prompt": "still"}, {"video": "b.gif", "prompt": "moving"}]),
        num_frames=5, frame_multiple=4)
    assert [ds.load(i).num_frames for i in range(2)] == [1, 5]


def test_mp4_gives_its_first_num_frames(tmp_path):
    write_mp4(tmp_path / "clip.mp4", 6)
    sample = _video_dataset(tmp_path, "clip.mp4", num_frames=5, frame_multiple=4).load(0)
    assert sample.pixels.shape == (3, 5, 48, 64)
    for got, want in zip(_frame_colors(sample.pixels), PALETTE):
        assert max(abs(g - w) for g, w in zip(got, want)) < 24  # H.264 is lossy


def test_mp4_shorter_than_num_frames_is_an_error(tmp_path):
    write_mp4(tmp_path / "clip.mp4", 8)
    with pytest.raises(DatasetError, match="clip.mp4: column 'video': the video has 8 frames, fewer than "
                                           "dataset.num_frames = 17"):
        _video_dataset(tmp_path, "clip.mp4", num_frames=17, frame_multiple=4).load(0)


@pytest.mark.parametrize("name, payload", [("broken.mp4", b"\x00\x00\x00\x18ftypmp42 garbage"),
                                           ("broken.gif", b"GIF89a garbage")])
def test_corrupt_video_names_file_and_row(tmp_path, name, payload):
    (tmp_path / name).write_bytes(payload)
    ds = _video_dataset(tmp_path, name, num_frames=5)
    with pytest.raises(DatasetError, match=r"data row 1 \(index 0\).*cannot decode") as info:
        ds.load(0)
    assert info.value.file == str(tmp_path / name)
    assert "ffmpeg version" not in str(info.value)  # ffmpeg's log is trimmed away


def test_empty_or_cut_video_is_an_error(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    write_mp4(tmp_path / "ok.mp4", 2)
    # A cut-off mp4 (ffmpeg also refuses a zero-frame mp4 at open) fails to decode.
    data = (tmp_path / "ok.mp4").read_bytes()
    (tmp_path / "empty.mp4").write_bytes(data[:64])
    ds = _video_dataset(tmp_path, "empty.mp4", num_frames=5, skip_bad_samples=True)
    assert ds.load(0) is None
    assert ds.skipped[0][1] == str(tmp_path / "empty.mp4")
    assert "no frames" in ds.skipped[0][2] or "cannot decode video" in ds.skipped[0][2]
