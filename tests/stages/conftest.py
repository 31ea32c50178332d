"""A demo work directory (drawn dataset + tiny Qwen-Image model), built once per test run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stages.config import RunConfig
from stages.demo import demo_config, write_demo_dataset, write_demo_model


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("assets")
    write_demo_dataset(root / "dataset")
    write_demo_model(root / "model")
    return root


@pytest.fixture
def make_config(demo_assets, tmp_path):
    """Config over a private copy of the dataset, with cache and output under tmp_path."""
    dataset = tmp_path / "dataset"
    shutil.copytree(demo_assets / "dataset", dataset)

    def build(*overrides: str) -> RunConfig:
        base = [f"dataset.base_path={dataset}", f"dataset.metadata_path={dataset / 'metadata.csv'}",
                f"model.path={demo_assets / 'model'}", f"cache.url={tmp_path / 'cache.zarr'}",
                f"output.path={tmp_path / 'output'}", "preprocess.parts=1"]
        return demo_config(tmp_path, overrides=base + list(overrides))

    return build


@pytest.fixture(scope="session")
def preprocessed_demo(demo_assets, tmp_path_factory) -> Path:
    """The demo dataset preprocessed once per run: ``config.toml`` over it and its ``cache.zarr``.

    Shared: tests copy the cache before changing it and point ``output.path`` at their own folder."""
    from stages import preprocess

    work = tmp_path_factory.mktemp("preprocessed")
    shutil.copytree(demo_assets / "dataset", work / "dataset")
    cfg = demo_config(work, overrides=[f"model.path={demo_assets / 'model'}", "preprocess.parts=1",
                                       "train.max_steps=4", "train.save_steps=2"])
    preprocess.run(cfg)
    cfg.save(work / "config.toml")
    return work
