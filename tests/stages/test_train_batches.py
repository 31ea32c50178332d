"""Batches over a real mixed-shape cache (the demo: 96x96 and 128x96 images, tiny Qwen-Image), caption
dropout from the cached empty prompt, EMA exports, and a SIGKILL + resume of all of it."""

import pytest
from safetensors.torch import load_file

from cache_store import open_cache
from diffsynth_core.errors import InputError
from diffsynth_core.training.metrics import read_metrics
from stages import preprocess, train
from stages.demo import demo_config
from stages.keys import empty_prompt_key, training_set
from stages.train import CachedSamples

from .sigkill import train_until_first_checkpoint

BUCKETS = {"16x1x12x12", "16x1x12x16"}  # latents of the two image sizes


@pytest.fixture(scope="module")
def cached(demo_assets, tmp_path_factory):
    """One preprocessed cache for the module; each test trains into its own output folder."""
    root = tmp_path_factory.mktemp("batches")
    dataset = demo_assets / "dataset"
    base = [f"dataset.base_path={dataset}", f"dataset.metadata_path={dataset / 'metadata.csv'}",
            f"model.path={demo_assets / 'model'}", f"cache.url={root / 'cache.zarr'}", "preprocess.parts=1"]

    def build(name, *overrides):
        return demo_config(root, overrides=[*base, f"output.path={root / name}", *overrides])

    preprocess.run(build("preprocess"))
    return build


@pytest.mark.parametrize("batch_size", [2, 4])
def test_a_mixed_shape_cache_trains_in_batches_of_one_bucket(cached, batch_size):
    cfg = cached(f"b{batch_size}", f"train.batch_size={batch_size}", "train.max_steps=4", "train.save_steps=0")
    found = training_set(cfg)  # each row's entry and its target-latents entry
    samples = CachedSamples(found.store, found.keys, found.latents)
    shapes = [samples.latent_shape(i) for i in range(len(samples))]  # from the manifest, no tensor read
    assert shapes == [tuple(samples[i]["latents"].shape) for i in range(len(samples))]
    assert {"x".join(map(str, s)) for s in shapes} == BUCKETS and len(shapes) == 16  # 8 of each
    train.run(cfg)
    rows = read_metrics(cfg.output_dir / "metrics.csv")
    assert [int(r["samples"]) for r in rows] == [batch_size] * 4  # 8 per bucket: full batches only
    assert {r["bucket"] for r in rows} == BUCKETS  # one bucket per step, both trained


def test_caption_dropout_trains_on_the_empty_prompt_stage_1_stored_once(cached, tmp_path):
    cfg = cached("dropout", "train.caption_dropout=0.5")
    store = open_cache(cfg.cache_url)
    key = empty_prompt_key(cfg, training_set(cfg).plan.text_fingerprint)
    assert store.has(key) and key not in store.keys()  # an auxiliary entry: stored once, no sample
    assert store.get(key)["meta"]["prompt"] == "" and store.stats()["aux_entries"] == 1
    # Only part 0 of a cache's writers encodes it: a cache of part 1 alone (trained with allow_partial) lacks it.
    partial = cached("dropout-partial", "train.caption_dropout=0.5", "preprocess.parts=2", "cache.allow_partial=true",
                     f"cache.url={tmp_path / 'part1.zarr'}")
    preprocess.run(partial, 1)
    with pytest.raises(InputError, match="empty prompt"):
        train.run(partial)
    assert not (partial.output_dir / "checkpoints").exists()


def test_a_sigkilled_run_with_buckets_dropout_and_ema_resumes_bit_for_bit(cached, tmp_path):
    options = ["train.batch_size=2", "train.caption_dropout=0.3", "train.ema_decay=0.9", "train.max_steps=12",
               "train.save_steps=2"]
    reference = cached("reference", *options)
    train.run(reference)
    cfg = cached("killed", *options)
    args = [f"{k}={v}" for k, v in (("dataset.base_path", cfg.dataset.base_path),
                                    ("dataset.metadata_path", cfg.dataset.metadata_path),
                                    ("model.path", cfg.model.path), ("cache.url", cfg.cache_url),
                                    ("output.path", cfg.output.path))]
    killed_at = train_until_first_checkpoint(tmp_path, [*args, *options], cfg.output_dir)
    assert 2 <= killed_at < 12, killed_at

    summary = train.run(cfg)
    assert summary.resumed_from == killed_at and summary.steps == 12
    for name in ("lora.safetensors", "lora_ema.safetensors"):
        got, expected = load_file(str(cfg.output_dir / name)), load_file(str(reference.output_dir / name))
        assert got.keys() == expected.keys() and all(got[k].equal(expected[k]) for k in expected), name
    raw, ema = (load_file(str(reference.output_dir / n)) for n in ("lora.safetensors", "lora_ema.safetensors"))
    assert any(not raw[k].equal(ema[k]) for k in raw)  # the average is its own set of weights
    rows, expected_rows = (read_metrics(c.output_dir / "metrics.csv") for c in (cfg, reference))
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 13)]
    assert [(r["loss"], r["samples"], r["bucket"]) for r in rows] == \
        [(r["loss"], r["samples"], r["bucket"]) for r in expected_rows]


@pytest.mark.parametrize("override, key", [("train.caption_dropout=1.5", "train.caption_dropout"),
                                           ("train.ema_decay=1", "train.ema_decay"),
                                           ("train.batch_size=0", "train.batch_size"),
                                           ("train.timestep_sampling='bogus'", "train.timestep_sampling")])
def test_bad_batch_dropout_ema_and_schedule_values_name_their_key(override, key):
    from stages.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config({}, [override])
