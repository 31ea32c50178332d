"""Prefect Secret blocks as values of ``cache.storage_options`` (``"prefect-secret:NAME"``).

Only ``flows/`` imports Prefect, so the resolver lives here and is registered with the stages'
reference resolver when a flow loads its config; the value then exists only in the dict
handed to ``open_cache``, never in a parameter, a log line or an artifact.
"""

from __future__ import annotations


def prefect_secret(name: str) -> str:
    from prefect.blocks.system import Secret

    return Secret.load(name).get()


def register_prefect_secrets() -> None:
    """Let ``stages.secrets`` resolve ``prefect-secret:NAME`` in this process."""
    from stages.secrets import register_resolver

    register_resolver("prefect-secret", prefect_secret)
