"""Metadata files: CSV, JSON and JSONL give the same records; bad files name themselves."""

from __future__ import annotations

import pytest

from diffsynth_core.data import DatasetError, load_metadata
from splitflow_media_files import write_metadata

ROWS = [
    {"image": "a.png", "prompt": "a red square", "note": "NA"},
    {"image": "sub/b.jpg", "prompt": "1984", "note": None},
    {"image": "c.webp", "prompt": "a, quoted \"comma\" prompt", "note": "x"},
]


@pytest.mark.parametrize("suffix", [".csv", ".json", ".jsonl"])
def test_formats_give_the_same_records(tmp_path, suffix):
    records = load_metadata(write_metadata(tmp_path / f"meta{suffix}", ROWS))
    # CSV cells stay strings ("NA", "1984" are not turned into NaN/int); empty → None.
    assert records == ROWS


def test_csv_with_byte_order_mark_and_padded_header(tmp_path):
    path = tmp_path / "meta.csv"
    path.write_text("\ufeffimage , prompt\na.png,hello\n", encoding="utf-8")
    assert load_metadata(path) == [{"image": "a.png", "prompt": "hello"}]


def test_jsonl_skips_blank_lines_and_names_a_bad_line(tmp_path):
    path = tmp_path / "meta.jsonl"
    path.write_text('{"image": "a.png", "prompt": "p"}\n\n{"image": \n')
    with pytest.raises(DatasetError, match=r"meta\.jsonl.*line 3 is not valid JSON"):
        load_metadata(path)
    path.write_text('{"image": "a.png", "prompt": "p"}\n\n')
    assert load_metadata(path) == [{"image": "a.png", "prompt": "p"}]


def test_json_must_be_a_list_of_objects(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text('{"image": "a.png"}')
    with pytest.raises(DatasetError, match=r"meta\.json: JSON metadata must be a list"):
        load_metadata(path)
    path.write_text('[{"image": "a.png", "prompt": "p"}, "oops"]')
    with pytest.raises(DatasetError, match=r"data row 2 \(index 1\): row is a str"):
        load_metadata(path)


def test_missing_empty_and_unknown_metadata(tmp_path):
    with pytest.raises(DatasetError, match="metadata file not found"):
        load_metadata(tmp_path / "nope.csv")
    (tmp_path / "meta.txt").write_text("image,prompt\n")
    with pytest.raises(DatasetError, match="unsupported metadata format '.txt'"):
        load_metadata(tmp_path / "meta.txt")
    (tmp_path / "empty.csv").write_text("image,prompt\n")
    with pytest.raises(DatasetError, match=r"empty\.csv: metadata has no rows"):
        load_metadata(tmp_path / "empty.csv")
