"""The Prefect client calls the flows make, in one place (thin flows stay readable)."""

from __future__ import annotations

import time

from prefect import get_client
from prefect.deployments import run_deployment


def start_run(deployment: str, parameters: dict):
    """Schedule a run of ``deployment`` (a worker of its pool picks it up); return its id."""
    return run_deployment(deployment, parameters=parameters, timeout=0).id


def wait_for_run(flow_run_id, poll_seconds: float = 2.0):
    """Block until the child flow run reaches a final state; return it."""
    with get_client(sync_client=True) as client:
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state is not None and flow_run.state.is_final():
                return flow_run
            time.sleep(poll_seconds)


def result_or(flow_run, default: dict) -> dict:
    """A child's return value when its result was persisted where this process can read it."""
    try:
        return flow_run.state.result()
    except Exception:  # MissingResult: results live on the worker's machine; the disk state is what counts
        return default
