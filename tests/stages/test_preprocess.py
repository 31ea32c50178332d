import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from cache_store import IncompleteCacheError, open_cache
from diffsynth_core.data import DatasetError
from stages import preprocess
from stages.keys import training_keys
from tests.stages.metadata import cached_entries, rewrite_metadata


def _assert_same_entries(url, reference_url):
    """Both caches hold the same keys with bitwise-equal tensors."""
    got, expected = cached_entries(url), cached_entries(reference_url)
    assert got.keys() == expected.keys()
    for key in expected:
        for name, tensor in expected[key].items():
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(got[key][name], tensor), (key, name)


def test_rerun_encodes_nothing_and_a_changed_caption_reencodes_one_entry(make_config):
    cfg = make_config()
    first = preprocess.run(cfg)
    assert (first.encoded, first.reused, first.complete) == (16, 0, True)
    assert preprocess.run(cfg).encoded == 0

    rewrite_metadata(cfg, lambda rows: [dict(r, prompt="a new caption") if i == 3 else r for i, r in enumerate(rows)])
    changed = preprocess.run(cfg)
    assert (changed.encoded, changed.reused) == (1, 15)


def test_removed_rows_are_not_trained_on(make_config):
    cfg = make_config()
    preprocess.run(cfg)
    rewrite_metadata(cfg, lambda rows: rows[:10])
    summary = preprocess.run(cfg)
    assert summary.encoded == 0 and summary.complete
    assert len(training_keys(cfg)[1]) == 10 and len(open_cache(cfg.cache_url, mode="r").keys()) == 2 * 16  # two each


def test_parts_fill_one_cache_and_changing_the_part_count_reencodes_nothing(make_config):
    cfg = make_config("preprocess.parts=3")
    encoded = sum(preprocess.run(cfg, part).encoded for part in range(3))
    assert encoded == 16 and preprocess.finalize(cfg).complete
    regrouped = make_config("preprocess.parts=2")
    assert sum(preprocess.run(regrouped, part).encoded for part in range(2)) == 0


def test_training_refuses_an_incomplete_cache_with_the_missing_count(make_config):
    cfg = make_config("preprocess.parts=2")
    preprocess.run(cfg, 0)
    assert not preprocess.finalize(cfg).complete
    with pytest.raises(IncompleteCacheError, match="8 of 16"):
        training_keys(cfg)


def test_missing_image_is_an_error_naming_file_and_row_and_nothing_written_is_lost(make_config):
    cfg = make_config()
    preprocess.run(cfg)
    before = sorted(open_cache(cfg.cache_url, mode="r").keys())
    rewrite_metadata(cfg, lambda rows: rows + [{"image": "missing.png", "prompt": "ghost"}])
    with pytest.raises(DatasetError, match="missing.png") as err:
        preprocess.run(cfg)
    assert "row" in str(err.value)
    assert sorted(open_cache(cfg.cache_url, mode="r").keys()) == before


def test_bad_rows_are_skipped_and_reported_when_asked(make_config):
    cfg = make_config("dataset.skip_bad_samples=true")
    (tmp := cfg.dataset.base_path) and open(os.path.join(tmp, "broken.png"), "wb").write(b"not a png")
    rewrite_metadata(cfg, lambda rows: rows + [{"image": "broken.png", "prompt": "broken"}])
    summary = preprocess.run(cfg)
    assert summary.encoded == 16 and summary.complete
    assert [item["row"] for item in summary.skipped] == [16] and "broken.png" in summary.skipped[0]["reason"]



def test_skipped_rows_are_recorded_in_the_cache_so_a_separate_finalize_completes(make_config):
    """Parts run as separate processes (pools) return nothing to finalize: the cache says what was skipped."""
    cfg = make_config("dataset.skip_bad_samples=true", "preprocess.parts=2")
    open(os.path.join(cfg.dataset.base_path, "broken.png"), "wb").write(b"not a png")
    rewrite_metadata(cfg, lambda rows: rows + [{"image": "broken.png", "prompt": "broken"}])
    for part in range(2):
        preprocess.run(cfg, part)
    store = open_cache(cfg.cache_url, mode="r")
    [(key, record)] = store.skipped().items()
    assert record["row"] == 16 and record["file"].endswith("broken.png") and record["reason"]
    final = preprocess.finalize(cfg)  # no skipped list handed over
    assert final.complete and [item["row"] for item in final.skipped] == [16]
    assert key not in training_keys(cfg)[1] and len(training_keys(cfg)[1]) == 16
    strict = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"skip_bad_samples": False})})
    assert not preprocess.finalize(strict).complete  # skip off again: the bad row is missing, not silently dropped
    with pytest.raises(IncompleteCacheError, match="1 of 17 .*data row 17.*skipped as bad"):
        training_keys(strict)


KILLABLE = """
import sys, time
from stages import preprocess
from stages.keys import training_keys
from stages.demo import demo_config
import diffsynth_core.models.qwen_image as family
encode = family.SPEC.encode_pixel_batch
def slow_encode(*args, **kwargs):
    time.sleep(0.15)  # widen the window so the kill lands mid-run
    return encode(*args, **kwargs)
object.__setattr__(family.SPEC, "encode_pixel_batch", slow_encode)
preprocess.run(demo_config(__import__("pathlib").Path(sys.argv[1]), overrides=sys.argv[2:]))
"""


def test_a_sigkilled_preprocess_resumes_to_the_same_cache_bit_for_bit(make_config, tmp_path):
    overrides = ["preprocess.commit_every=2"]
    cfg = make_config(*overrides)
    args = [f"dataset.base_path={cfg.dataset.base_path}", f"dataset.metadata_path={cfg.dataset.metadata_path}",
            f"model.path={cfg.model.path}", f"cache.url={cfg.cache_url}", f"output.path={cfg.output.path}",
            "preprocess.parts=1", *overrides]
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, str(tmp_path), *args], cwd=os.getcwd())
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if len(open_cache(cfg.cache_url, mode="r").keys()) >= 4:
                break
        except (FileNotFoundError, Exception):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = len(open_cache(cfg.cache_url, mode="r").keys()) // 2  # rows: each commits two entries at once
    assert 2 <= partial < 16, partial

    resumed = preprocess.run(cfg)
    assert resumed.encoded == 16 - partial and resumed.complete
    reference = make_config(*overrides, f"cache.url={tmp_path / 'reference.zarr'}")
    preprocess.run(reference)
    _assert_same_entries(cfg.cache_url, reference.cache_url)


def test_changing_max_pixels_reencodes_only_the_images_it_resizes(make_config):
    # The demo has 96x96 (9216 px) and 128x96 (12288 px) images; 10000 px shrinks only the larger.
    preprocess.run(make_config())
    changed = preprocess.run(make_config("dataset.max_pixels=10000"))
    assert (changed.encoded, changed.reused) == (8, 8)
    store, keys = training_keys(make_config("dataset.max_pixels=10000"))
    shrunk = [store.get(k)["meta"] for k in keys]
    assert {(m["height"], m["width"]) for m in shrunk} == {(96, 96), (80, 112)}


def test_encoders_streamed_by_the_offload_engine_give_the_same_cache(make_config, tmp_path):
    plain = make_config("dataset.max_pixels=4096")
    preprocess.run(plain)
    streamed = make_config("dataset.max_pixels=4096", "preprocess.offload_encoders=true",
                           f"cache.url={tmp_path / 'streamed.zarr'}")
    preprocess.run(streamed)
    _assert_same_entries(streamed.cache_url, plain.cache_url)
