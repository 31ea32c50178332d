"""Shared test set-up: offline hub, Prefect isolated in a temp home, GPU marker."""

from __future__ import annotations

import os
import tempfile

# Must be set before Prefect or the HF libraries are imported anywhere in the test run.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="splitflow-prefect-"))
# One CPU thread a test process (inherited by the processes tests start): `make test` runs two workers on two
# cores, and tiny models' kernels spent most of their time in thread hand-offs when each asked for both cores
# (a 48-step tiny edit run: 1.7 s with one thread, 18-35 s with two).  One thread also makes every process of a
# run round alike (bit-for-bit resume across processes).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# the digest memo of the run, not the user's ~/.cache/splitflow
os.environ.setdefault("SPLITFLOW_CACHE_DIR", tempfile.mkdtemp(prefix="splitflow-cache-"))

import diffsynth_core  # noqa: E402,F401  (before torch: it fixes MKL's thread count, see its __init__)
import pytest  # noqa: E402
import torch  # noqa: E402


# Modules that wait minutes on Prefect servers and process workers: collected first, so that with
# several test processes (`make test`) one of them starts there while the others take the rest.
LONGEST_FIRST = ("tests/flows/test_pools.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)  # stable: otherwise as collected
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server (SQLite in a temp dir) for the whole test run."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


@pytest.fixture(scope="session")
def released_models(tmp_path_factory):
    """``family -> root``: tiny models as DiffSynth keeps releases (``root/models/<model_id>/...``)
    and in the diffusers layout (``root/reference``); built once per run (tests/core/models/released_layouts.py)."""
    from tests.core.models.released_layouts import build_release

    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = build_release(family, tmp_path_factory.mktemp(f"release-{family}"))
        return cache[family]

    return get
