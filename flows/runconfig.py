"""The config a flow run loads: where the config is (a path or URL) plus ``--set`` overrides.

Flow parameters, deployments and logs are readable by anyone with access to the Prefect API,
and a ``RunConfig`` may hold credentials (``cache.storage_options``).  So flows never receive a
``RunConfig``: they receive its reference and load it inside the run, which also makes one
deployment serve every later edit of the config file.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from stages.config import ConfigError, RunConfig, build_config, load_config

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)
SECRET_SECTION = "cache.storage_options"


def config_reference(config: str | os.PathLike | None) -> str | None:
    """A local config as an absolute path (workers may start elsewhere); URLs unchanged."""
    if config is None:
        return None
    text = os.fspath(config)
    return text if _URL.match(text) else str(Path(text).resolve())


def check_overrides(overrides: list[str]) -> list[str]:
    """Refuse ``--set cache.storage_options=...``: overrides become run parameters, readable by API users."""
    for item in overrides:
        if item.split("=", 1)[0].strip().startswith(SECRET_SECTION):
            raise ConfigError(f"--set {SECRET_SECTION}: overrides are recorded as Prefect run parameters, readable "
                              "through the API; put storage options in the config file (as references such as "
                              "${AWS_SECRET_ACCESS_KEY}) instead")
    return list(overrides)


def load_run_config(config: str | None, overrides: list[str] | None = None) -> RunConfig:
    """Load the config named by ``config`` (a path, or any fsspec URL) and apply ``overrides``."""
    from .secrets import register_prefect_secrets

    register_prefect_secrets()  # storage options may name Prefect Secret blocks; resolved where used
    overrides = list(overrides or [])
    if config is None:
        return build_config({}, overrides, source="--set overrides")
    if not _URL.match(config) or config.startswith("file://"):
        return load_config(config.removeprefix("file://"), overrides)
    import fsspec

    suffix = Path(config.split("?", 1)[0]).suffix or ".toml"
    try:
        with fsspec.open(config, "rb") as remote:
            data = remote.read()
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read config {config}: {err}") from err
    with tempfile.TemporaryDirectory() as folder:
        local = Path(folder) / f"config{suffix}"
        local.write_bytes(data)
        cfg = load_config(local, overrides)
    return cfg


def run_name(config: str | None, name: str | None = None) -> str:
    """``--name``, else the config file's name (its folder's for a generic ``config.toml``)."""
    if not name and config:
        path = Path(config.split("?", 1)[0])
        name = path.parent.name if path.stem in ("config", "run", "") and path.parent.name else path.stem
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name or "splitflow").strip("-.")
    return name or "splitflow"
