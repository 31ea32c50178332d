"""The Prefect client calls the flows and the coordinator make, in one place.

Every function here is one request (or a few) to the Prefect API and may raise the client's
connection errors; the coordinator decides what an unreachable API means (flows/coordinator.py).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from uuid import UUID

import httpx
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey,
                                            ArtifactFilterType, FlowRunFilter, FlowRunFilterState,
                                            FlowRunFilterStateType, FlowRunFilterTags, TaskRunFilter,
                                            TaskRunFilterState, TaskRunFilterStateType, TaskRunFilterTags)
from prefect.client.schemas.objects import FlowRun, StateType, TaskRun
from prefect.client.schemas.sorting import FlowRunSort
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Completed, Crashed, Failed, Running

from .server import api_healthy

FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}
SLOT_HOLDING = [StateType.PENDING, StateType.RUNNING]  # what a work pool's concurrency limit counts
_NEW_STATE = {"completed": Completed, "crashed": Crashed, "cancelled": Cancelled, "failed": Failed}


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
        return self.last_beats([run_id]).get(run_id)

    def last_beats(self, run_ids: list[UUID]) -> dict[UUID, datetime]:
        """Run id -> when its progress artifact (heartbeat) was last updated (server time), in one request."""
        artifacts = self.client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=list(run_ids)), type=ArtifactFilterType(any_=["progress"])))
        beats: dict[UUID, datetime] = {}
        for artifact in artifacts:
            when = artifact.updated or artifact.created
            beats[artifact.flow_run_id] = max(when, beats.get(artifact.flow_run_id, when))
        return beats

    def table(self, run_id: UUID, key: str) -> list[dict] | None:
        """The rows of run ``run_id``'s table artifact ``key``, or None when it has none."""
        artifacts = self.client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), key=ArtifactFilterKey(any_=[key])))
        data = artifacts[0].data if artifacts else None
        return json.loads(data) if isinstance(data, str) else data

    def unfinished_runs(self, tags: list[str]) -> list[FlowRun]:
        """Runs carrying all ``tags`` that are not in a final state (scheduled, pending, running...)."""
        return self.client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=tags),
            state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=sorted(FINAL)))))

    def unfinished_task_runs(self, tags: list[str]) -> list[TaskRun]:
        """Task runs carrying all ``tags`` that are not in a final state."""
        return self.client.read_task_runs(task_run_filter=TaskRunFilter(
            tags=TaskRunFilterTags(all_=tags),
            state=TaskRunFilterState(type=TaskRunFilterStateType(not_any_=sorted(FINAL)))))

    def recent_runs(self, tags: list[str], limit: int = 200) -> list[FlowRun]:
        """The newest ``limit`` runs carrying all ``tags``, whatever their state."""
        return self.client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags)),
                                          sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=limit)

    def slot_holders(self, tags: list[str]) -> list[FlowRun]:
        """Runs carrying all ``tags`` in a state a work pool's limit counts (Pending, Running)."""
        state = FlowRunFilterState(type=FlowRunFilterStateType(any_=SLOT_HOLDING))
        return self.client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags), state=state))

    def set_state(self, run_id: UUID, kind: str, message: str) -> None:
        """Force a run into ``kind`` (completed | crashed | cancelled | failed): what disk says it is."""
        self.client.set_flow_run_state(run_id, _NEW_STATE[kind](message=message), force=True)

    def set_task_state(self, task_run_id: UUID, kind: str, message: str) -> None:
        self.client.set_task_run_state(task_run_id, _NEW_STATE[kind](message=message), force=True)

    def cancel_if_scheduled(self, run_id: UUID, message: str) -> bool:
        """Cancel a run still waiting for a worker (Scheduled or Late); False when it has started."""
        if not self.read_run(run_id).state.is_scheduled():
            return False
        self.set_state(run_id, "cancelled", message)
        return True

    def open_run(self, flow, name: str, parameters: dict, tags: list[str]) -> UUID:
        """A Running flow run of ``flow`` for work this process does itself (no worker, no engine)."""
        return self.client.create_flow_run(flow, name=name, parameters=parameters, tags=tags, state=Running()).id


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
