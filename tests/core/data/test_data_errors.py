"""Bad rows raise DatasetError naming the metadata file, the row and the media file;
skip_bad_samples skips and reports them instead."""

from __future__ import annotations

import pytest

from diffsynth_core.data import DatasetError, SampleDataset
from splitflow_media_files import write_image, write_metadata


def _bad_rows(tmp_path):
    write_image(tmp_path / "good.png", 32, 32)
    write_image(tmp_path / "thin.png", 200, 10)
    (tmp_path / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg")
    good = tmp_path / "good2.jpg"
    write_image(good, 64, 64)
    (tmp_path / "truncated.jpg").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    return [
        {"image": "good.png", "prompt": "ok"},                    # index 0
        {"image": "missing.png", "prompt": "gone"},               # index 1
        {"image": "corrupt.jpg", "prompt": "garbage"},            # index 2
        {"image": "truncated.jpg", "prompt": "half a file"},      # index 3
        {"image": "thin.png", "prompt": "too thin"},              # index 4
        {"image": None, "prompt": "no media"},                    # index 5
        {"image": "good.png", "prompt": None},                    # index 6
        {"image": "notes.txt", "prompt": "wrong type"},           # index 7
    ]


EXPECTED = {
    1: ("missing.png", "file not found"),
    2: ("corrupt.jpg", "cannot decode image"),
    3: ("truncated.jpg", "cannot decode image"),
    4: ("thin.png", "too small"),
    5: (None, "expected exactly one media file"),
    6: (None, "column 'prompt' must hold text"),
    7: ("notes.txt", "unsupported file type '.txt'"),
}


@pytest.mark.parametrize("index", sorted(EXPECTED))
def test_bad_row_error_names_metadata_row_and_file(tmp_path, index):
    metadata = write_metadata(tmp_path / "metadata.csv", _bad_rows(tmp_path))
    ds = SampleDataset(metadata)
    file, reason = EXPECTED[index]
    with pytest.raises(DatasetError) as info:
        ds.load(index)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(metadata) in message and reason in message
    assert f"data row {index + 1} (index {index})" in message
    assert info.value.row == index
    if file is not None:
        assert str(tmp_path / file) in message and info.value.file == str(tmp_path / file)
    assert ds.load(0) is not None


def test_skip_bad_samples_skips_and_reports(tmp_path):
    ds = SampleDataset(write_metadata(tmp_path / "metadata.jsonl", _bad_rows(tmp_path)),
                       skip_bad_samples=True, repeat=2)
    samples = [ds[i] for i in range(len(ds))]
    assert [s.row for s in samples if s is not None] == [0, 0]
    assert [row for row, _, _ in ds.skipped] == sorted(EXPECTED)  # each bad row once
    for row, file, reason in ds.skipped:
        expected_file, expected_reason = EXPECTED[row]
        assert expected_reason in reason
        assert file == ("" if expected_file is None else str(tmp_path / expected_file))


def test_source_files_with_skip_returns_empty_for_unresolvable_rows(tmp_path):
    ds = SampleDataset(write_metadata(tmp_path / "metadata.json", _bad_rows(tmp_path)),
                       skip_bad_samples=True)
    assert ds.source_files(0) == [tmp_path / "good.png"]
    assert ds.source_files(1) == []  # missing file: nothing to fingerprint
    assert ds.source_files(2) == [tmp_path / "corrupt.jpg"]  # found only when decoded
    assert [row for row, _, _ in ds.skipped] == [1]
    assert ds.load(1) is None and ds.load(2) is None
    assert [row for row, _, _ in ds.skipped] == [1, 2]


def test_source_files_without_skip_raises_for_missing_file(tmp_path):
    ds = SampleDataset(write_metadata(tmp_path / "metadata.csv", _bad_rows(tmp_path)))
    message = r"data row 2 \(index 1\).*missing\.png: column 'image': file not found"
    with pytest.raises(DatasetError, match=message):
        ds.source_files(1)


def test_two_media_cells_in_one_row_is_an_error(tmp_path):
    write_image(tmp_path / "a.png", 16, 16)
    ds = SampleDataset(write_metadata(tmp_path / "m.csv", [
        {"image": "a.png", "video": "a.png", "prompt": "p"}]))
    message = r"exactly one media file in columns \['image', 'video'\], found image, video"
    with pytest.raises(DatasetError, match=message):
        ds.load(0)


def test_list_and_url_cells_are_errors(tmp_path):
    ds = SampleDataset(write_metadata(tmp_path / "m.json", [
        {"image": ["a.png", "b.png"], "prompt": "p"},
        {"image": "https://example.com/a.png", "prompt": "p"}]))
    with pytest.raises(DatasetError, match="must hold one file path"):
        ds.load(0)
    with pytest.raises(DatasetError, match="URLs are not supported"):
        ds.load(1)


def test_error_keeps_its_parts_across_pickling(tmp_path):
    import pickle

    error = DatasetError("file not found", metadata=tmp_path / "m.csv", row=4, file="a.png")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.reason, copy.metadata, copy.row, copy.file, str(copy)) == (
        error.reason, error.metadata, 4, "a.png", str(error))
    assert str(error) == f"{tmp_path / 'm.csv'}, data row 5 (index 4), file a.png: file not found"
