"""Identity: a cache and a checkpoint are used only with the model weights they were made with."""

from __future__ import annotations

import logging
import shutil

import pytest

from cache_store import CacheFormatError, fingerprint_of
from diffsynth_core.errors import InputError
from diffsynth_core.models import get_family
from stages import preprocess, train
from stages.common import encoder_identity
from stages.identity import METADATA_KEY, base_model
from stages.resume_rule import SETTINGS_KEY, settings
from tests.stages.metadata import keep_rows


def edit_in_place(path) -> None:
    """A same-size edit of a weights file (as fine-tuning and saving over it does): one mantissa bit."""
    data = bytearray(path.read_bytes())
    data[-4] ^= 1
    path.write_bytes(bytes(data))


@pytest.fixture
def own_model(demo_assets, tmp_path):
    """A private copy of the tiny model, which a test may edit."""
    return shutil.copytree(demo_assets / "model", tmp_path / "model")


def test_a_same_size_vae_edit_changes_the_fingerprint_and_the_cache_refuses_it(make_config, own_model):
    """A cache is one latent space: other VAE weights are refused, naming both fingerprints."""
    cfg = make_config(f"model.path={own_model}")
    keep_rows(cfg, 2)
    fingerprint = preprocess.make_plan(cfg).fingerprint
    assert preprocess.make_plan(cfg).fingerprint == fingerprint  # same files, same identity
    assert preprocess.run(cfg).encoded == 2

    weights = next((own_model / "vae").glob("*.safetensors"))
    size = weights.stat().st_size
    edit_in_place(weights)
    assert weights.stat().st_size == size
    edited = preprocess.make_plan(cfg).fingerprint
    assert edited != fingerprint
    both = f"'{fingerprint}'.*'{edited}'"
    with pytest.raises(CacheFormatError, match=both):  # no "0 encoded, 2 already cached"
        preprocess.run(cfg)
    with pytest.raises(CacheFormatError, match=both):
        train.run(cfg)
    assert not (cfg.output_dir / "checkpoints").exists()


def test_a_same_size_text_encoder_edit_reencodes_the_prompts_and_reuses_the_latents(make_config, own_model):
    """Prompt entries are keyed by the text encoder's files: an edit there never serves a stale embedding,
    while the target latents (keyed by the VAE) stay valid and are reused."""
    cfg = make_config(f"model.path={own_model}")
    keep_rows(cfg, 2)
    spec = get_family(cfg.model.family)
    fingerprint = fingerprint_of(encoder_identity(cfg, spec))
    before = preprocess.make_plan(cfg)
    assert preprocess.run(cfg).encoded == 2

    edit_in_place(own_model / "text_encoder" / "model.safetensors")
    assert fingerprint_of(encoder_identity(cfg, spec)) != fingerprint
    after = preprocess.make_plan(cfg)
    assert after.latent_keys == before.latent_keys and set(after.keys.values()).isdisjoint(before.keys.values())
    summary = preprocess.run(cfg)
    assert (summary.encoded, summary.reused, summary.latents_encoded, summary.latents_reused) == (2, 0, 0, 2)


def test_train_refuses_a_cache_encoded_for_another_family_naming_both(make_config, tmp_path):
    cfg = make_config()
    keep_rows(cfg, 2)
    preprocess.run(cfg)
    other = make_config("model.family=flux", f"model.path={tmp_path / 'no-flux-model-needed'}")
    with pytest.raises(CacheFormatError, match="family 'qwen_image'.*family 'flux'"):
        train.run(other)
    assert not (other.output_dir / "checkpoints").exists()


def test_resume_refuses_a_checkpoint_trained_on_another_base_model(make_config, own_model):
    cfg = make_config(f"model.path={own_model}", "train.max_steps=1")
    keep_rows(cfg, 2)
    preprocess.run(cfg)
    train.run(cfg)
    spec = get_family(cfg.model.family)
    trained_on = base_model(cfg, spec)
    saved = train.CheckpointManager(cfg.output_dir / "checkpoints").latest_metadata()
    assert saved[METADATA_KEY] == trained_on

    edit_in_place(own_model / "transformer" / "diffusion_pytorch_model.safetensors")
    other_base = base_model(cfg, spec)["fingerprint"]
    assert other_base != trained_on["fingerprint"]
    longer = make_config(f"model.path={own_model}", "train.max_steps=2")
    with pytest.raises(InputError, match=f"{trained_on['fingerprint']}.*{other_base}"):
        train.run(longer)


def test_a_resume_with_other_numerics_goes_on_and_says_it_will_not_end_bit_for_bit(make_config, caplog):
    streamed = "offload.enable_model_cpu_offload=true"
    cfg = make_config("train.max_steps=1", streamed)
    keep_rows(cfg, 2)
    preprocess.run(cfg)
    train.run(cfg)
    saved = train.CheckpointManager(cfg.output_dir / "checkpoints").latest_metadata()
    assert saved[SETTINGS_KEY] == settings(cfg) and saved[SETTINGS_KEY]["train.deterministic"] is False

    with caplog.at_level(logging.WARNING, logger="stages.resume_rule"):
        assert train.run(make_config("train.max_steps=2", streamed)).resumed_from == 1  # only the steps: no numerics
    assert not [r for r in caplog.records if "bit for bit" in r.getMessage()]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stages.resume_rule"):
        summary = train.run(make_config("train.max_steps=3", streamed, "train.deterministic=true"))
    assert summary.resumed_from == 2 and summary.steps == 3
    warned = [r.getMessage() for r in caplog.records if "bit for bit" in r.getMessage()]
    assert len(warned) == 1 and "train.deterministic False -> True" in warned[0], warned
    assert "checkpoints/step-00000002" in warned[0]
