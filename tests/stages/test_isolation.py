"""Isolation: each config trains on exactly its own entries of a shared cache, derived from the config."""

from __future__ import annotations

import pytest

from cache_store import IncompleteCacheError, open_cache
from stages import preprocess, train
from stages.keys import make_plan, training_keys
from stages.status import run_status
from tests.stages.metadata import keep_rows, rewrite_metadata


def test_two_configs_sharing_a_cache_each_train_on_exactly_their_entries(make_config):
    # demo images alternate 96x96 and 128x96; max_pixels=10000 shrinks only the 128x96 ones
    large = make_config()
    keep_rows(large, 4)
    small = make_config("dataset.max_pixels=10000")
    preprocess.run(large)
    assert preprocess.run(small).encoded == 2  # the two 96x96 entries are shared
    preprocess.run(large)  # the last one to finalize no longer decides for the other

    store = open_cache(large.cache_url, mode="r")
    assert len(store.keys()) == 2 * 6  # six rows, each a conditioning entry and a target-latents entry
    for cfg, sizes in ((large, {(96, 96), (96, 128)}), (small, {(96, 96), (80, 112)})):
        _, keys = training_keys(cfg)
        assert keys == list(make_plan(cfg).keys.values())
        assert {(store.get(k)["meta"]["height"], store.get(k)["meta"]["width"]) for k in keys} == sizes
        status = run_status(cfg)["cache"]
        assert (status["expected"], status["present"], status["missing"], status["complete"]) == (4, 4, 0, True)


def test_a_partial_cache_or_an_edited_metadata_is_refused_before_any_step(make_config):
    cfg = make_config("preprocess.parts=2")
    keep_rows(cfg, 4)
    preprocess.run(cfg, 0)  # only part 1 of 2
    status = run_status(cfg)["cache"]
    assert (status["expected"], status["present"], status["missing"], status["complete"]) == (4, 2, 2, False)
    with pytest.raises(IncompleteCacheError, match="2 of 4 rows this config trains on are missing.*data row 2"):
        train.run(cfg)
    partial = make_config("preprocess.parts=2", "cache.allow_partial=true")
    assert len(training_keys(partial)[1]) == 2

    preprocess.run(cfg, 1)
    assert run_status(cfg)["cache"]["complete"]
    # row 3 edited after preprocessing; train alone is run
    rewrite_metadata(cfg, lambda rows: [dict(r, prompt="an edited caption") if i == 2 else r
                                        for i, r in enumerate(rows)])
    with pytest.raises(IncompleteCacheError, match="1 of 4 .*data row 3"):
        train.run(cfg)
    assert not (cfg.output_dir / "checkpoints").exists()


def test_identical_rows_are_one_entry_trained_on_as_often_as_listed(make_config):
    cfg = make_config()
    rewrite_metadata(cfg, lambda rows: [rows[0], rows[0], rows[1], rows[0]])  # row 0 up-weighted three times
    summary = preprocess.run(cfg)
    assert (summary.encoded, summary.complete) == (2, True)
    _, keys = training_keys(cfg)
    assert len(keys) == 4 and keys[0] == keys[1] == keys[3] != keys[2]
    assert run_status(cfg)["cache"]["expected"] == 4


def test_an_imported_cache_trains_on_the_keys_recorded_at_import(make_config, tmp_path):
    """A DiffSynth import names its origin instead of an encoder fingerprint: nothing to derive keys from."""
    from tests.cache_store.samples import key_of, make_entry

    url = tmp_path / "imported.zarr"
    store = open_cache(url, "a", fingerprint="diffsynth-import", writer="diffsynth-import")
    for i in range(3):
        store.put(key_of(i), make_entry(i))
    store.commit()
    store.set_dataset_keys([key_of(2), key_of(0)])
    cfg = make_config(f"cache.url={url}", f"model.path={tmp_path / 'only-the-transformer-is-needed'}")
    assert training_keys(cfg)[1] == [key_of(2), key_of(0)]
    assert run_status(cfg)["cache"]["complete"]
