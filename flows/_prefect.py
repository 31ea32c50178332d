"""The Prefect client calls the flows and the coordinator make, in one place.

Every function here is one request (or a few) to the Prefect API and may raise the client's
connection errors; the coordinator decides what an unreachable API means (flows/coordinator.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from uuid import UUID

import httpx
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType,
                                            FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                            FlowRunFilterTags)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Completed, Crashed

from .server import api_healthy

FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}
_NEW_STATE = {"completed": Completed, "crashed": Crashed, "cancelled": Cancelled}


def is_outage(err: BaseException) -> bool:
    """Whether ``err`` means the API is unreachable or overloaded (not a bad request)."""
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code >= 500
    return isinstance(err, (httpx.TransportError, OSError)) or "Failed to reach API" in str(err)


def api_lost(err: BaseException, url: str | None) -> bool:
    """Whether ``err`` is an outage of the API at ``url`` that its health confirms.

    ``is_outage`` counts every OSError: one from the cache's disk or network (EIO, ECONNRESET)
    while the API answers is the stage's failure, not Prefect's.  The health is asked once per
    error and the answer kept on it: the retry decision, the console filter and the exit message
    all judge one failure, and must agree even if the API comes or goes in between.
    """
    if not (is_outage(err) and url):
        return False
    lost = getattr(err, "_splitflow_api_lost", None)
    if lost is None:
        lost = not api_healthy(url)
        try:
            err._splitflow_api_lost = lost
        except AttributeError:  # an exception type without a __dict__: ask again next time
            pass
    return lost


class PrefectApi:
    """One client for the coordinator's many small requests (a client per call costs CPU on both ends)."""

    def __init__(self):
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = get_client(sync_client=True)
            self._client.__enter__()
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.__exit__(None, None, None)
            self._client = None

    def submit(self, deployment: str, parameters: dict, name: str, tags: list[str], delay_s: float = 0.0,
               idempotency_key: str | None = None) -> UUID:
        """Schedule a run of ``deployment`` ``delay_s`` from now (a worker of its pool picks it up)."""
        when = datetime.now(timezone.utc) + timedelta(seconds=delay_s)
        run = run_deployment(deployment, parameters=parameters, flow_run_name=name, tags=tags, timeout=0,
                             scheduled_time=when, idempotency_key=idempotency_key)
        return run.id

    def read_run(self, run_id: UUID) -> FlowRun:
        return self.client.read_flow_run(run_id)

    def last_beat(self, run_id: UUID) -> datetime | None:
        """When the run's progress artifact (its heartbeat) was last updated, or None before the first."""
        artifacts = self.client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), type=ArtifactFilterType(any_=["progress"])))
        return max((a.updated or a.created for a in artifacts), default=None)

    def unfinished_runs(self, tags: list[str]) -> list[FlowRun]:
        """Runs carrying all ``tags`` that are not in a final state (scheduled, pending, running...)."""
        return self.client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=tags),
            state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=sorted(FINAL)))))

    def set_state(self, run_id: UUID, kind: str, message: str) -> None:
        """Force a run into ``kind`` (completed | crashed | cancelled): what disk says it is."""
        self.client.set_flow_run_state(run_id, _NEW_STATE[kind](message=message), force=True)


def ensure_process_pool(name: str) -> bool:
    """Create work pool ``name`` (type process) unless it exists; True when created."""
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
            return True
