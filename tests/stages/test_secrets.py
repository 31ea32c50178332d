"""Secrets in cache.storage_options: references on disk, values only where the store is opened."""

from __future__ import annotations

import stat
import uuid

import pytest

from diffsynth_core.errors import InputError
from stages import preprocess, secrets, train
from stages.config import load_config
from stages.status import run_status
from tests.cache_store.conftest import s3_bucket, s3_server  # noqa: F401 - moto's real server
from tests.stages.metadata import keep_rows


def test_references_resolve_from_the_environment_and_registered_resolvers(monkeypatch):
    # flows tests earlier in the session register the Prefect resolver in this process: start bare
    monkeypatch.setattr(secrets, "_RESOLVERS", {})
    monkeypatch.setenv("SPLITFLOW_TEST_SECRET", "s3cr3t")
    options = {"secret": "${SPLITFLOW_TEST_SECRET}", "client_kwargs": {"endpoint_url": "http://h:${SPLITFLOW_PORT}"},
               "note": "costs $${DOLLARS}", "retries": 3}
    monkeypatch.setenv("SPLITFLOW_PORT", "9000")
    assert secrets.resolve(options, "cache.storage_options") == {
        "secret": "s3cr3t", "client_kwargs": {"endpoint_url": "http://h:9000"}, "note": "costs ${DOLLARS}",
        "retries": 3}
    monkeypatch.delenv("SPLITFLOW_PORT")
    with pytest.raises(InputError, match=r"cache.storage_options.client_kwargs.endpoint_url references "
                                         r"\$\{SPLITFLOW_PORT\}, which is not set"):
        secrets.resolve(options, "cache.storage_options")
    with pytest.raises(InputError, match="cache.storage_options.token = 'prefect-secret:s3-token' names a Prefect"):
        secrets.resolve({"token": "prefect-secret:s3-token"}, "cache.storage_options")
    vault = {"s3-token": "from-the-block"}  # what flows registers: lambda name: Secret.load(name).get()
    secrets.register_resolver("prefect-secret", vault.__getitem__)
    try:
        assert secrets.resolve({"token": "prefect-secret:s3-token"}, "x") == {"token": "from-the-block"}
        with pytest.raises(InputError, match="x.token: cannot resolve 'prefect-secret:missing'"):
            secrets.resolve({"token": "prefect-secret:missing"}, "x")
    finally:
        secrets.unregister_resolver("prefect-secret")


def test_no_secret_is_written_under_the_output_folder(make_config, s3_bucket, monkeypatch, tmp_path):  # noqa: F811
    bucket, options = s3_bucket
    key, secret = f"AKIA{uuid.uuid4().hex[:12].upper()}", f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("SPLITFLOW_TEST_S3_KEY", key)  # moto accepts any credentials
    monkeypatch.setenv("SPLITFLOW_TEST_S3_SECRET", secret)
    storage = ('{key = "${SPLITFLOW_TEST_S3_KEY}", secret = "${SPLITFLOW_TEST_S3_SECRET}", '
               f'client_kwargs = {{endpoint_url = "{options["client_kwargs"]["endpoint_url"]}", '
               'region_name = "us-east-1"}}')
    cfg = make_config(f"cache.url=s3://{bucket}/cache.zarr", f"cache.storage_options={storage}", "train.max_steps=1")
    keep_rows(cfg, 2)
    assert preprocess.run(cfg).complete
    train.run(cfg)
    assert run_status(cfg)["cache"]["complete"]

    saved = cfg.output_dir / "config.toml"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert "${SPLITFLOW_TEST_S3_SECRET}" in saved.read_text()
    assert load_config(saved).cache.storage_options["secret"] == "${SPLITFLOW_TEST_S3_SECRET}"
    files = [p for p in cfg.output_dir.rglob("*") if p.is_file()]
    assert len(files) >= 5  # config, lock, metrics, checkpoint files, LoRA exports
    for path in files:
        data = path.read_bytes()
        assert secret.encode() not in data and key.encode() not in data, path
    assert secret not in str(run_status(cfg))
