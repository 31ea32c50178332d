"""Content keys: what changes a key, and what does not."""

from __future__ import annotations

import numpy as np
import pytest

from cache_store import entry_key, fingerprint_of

SETTINGS = {"max_pixels": 1048576, "height": None, "width": None, "max_sequence_length": 512,
            "encoders": {"family": "qwen_image", "text_encoder": "sha256:ab", "vae": "sha256:cd"}}


@pytest.fixture
def rows(tmp_path):
    files = []
    for i in range(4):
        f = tmp_path / f"img{i}.png"
        f.write_bytes(bytes([i]) * 100)
        files.append(f)
    fields = [{"image": f.name, "prompt": f"caption {i}"} for i, f in enumerate(files)]
    return fields, files


def keys_of(fields, files, settings):
    return [entry_key(r, [f], settings) for r, f in zip(fields, files)]


def test_changing_one_caption_changes_one_key(rows):
    fields, files = rows
    before = keys_of(fields, files, SETTINGS)
    fields[2] = {**fields[2], "prompt": "a new caption"}
    after = keys_of(fields, files, SETTINGS)
    assert [a != b for a, b in zip(before, after)] == [False, False, True, False]


def test_changing_file_bytes_changes_that_key(rows):
    fields, files = rows
    before = keys_of(fields, files, SETTINGS)
    files[1].write_bytes(b"edited image")
    after = keys_of(fields, files, SETTINGS)
    assert [a != b for a, b in zip(before, after)] == [False, True, False, False]


def test_settings_and_encoder_identity_change_every_key(rows):
    fields, files = rows
    base = set(keys_of(fields, files, SETTINGS))
    for change in ({"max_pixels": 512 * 512}, {"max_sequence_length": 256},
                   {"encoders": {**SETTINGS["encoders"], "vae": "sha256:ef"}}):
        changed = set(keys_of(fields, files, {**SETTINGS, **change}))
        assert not changed & base, change


def test_keys_ignore_dict_order_and_are_stable():
    a = entry_key({"prompt": "x", "image": "a.png"}, [], {"b": 1, "a": [1, 2]})
    b = entry_key({"image": "a.png", "prompt": "x"}, [], {"a": [1, 2], "b": 1})
    assert a == b and len(a) == 32 and int(a, 16) >= 0
    # fixed value: a silent change of the hashing scheme would orphan every existing cache
    assert fingerprint_of({"a": 1}) == fingerprint_of({"a": np.int64(1)}) == "015abd7f5cc57a2dd94b7590f04ad808"


def test_pandas_style_values_are_canonical():
    # blank CSV cells arrive as NaN, integers as numpy scalars, lists as tuples
    assert fingerprint_of({"x": float("nan"), "n": np.int64(3), "t": (1, 2)}) == \
        fingerprint_of({"x": None, "n": 3, "t": [1, 2]})


def test_unhashable_values_and_missing_files_are_named(tmp_path):
    with pytest.raises(TypeError, match=r"fields.extra: value of type set"):
        entry_key({"extra": {1, 2}}, [], {})
    with pytest.raises(FileNotFoundError, match="gone.png"):
        entry_key({}, [tmp_path / "gone.png"], {})
