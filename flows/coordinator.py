"""The pool coordinator: stage runs on work pools, re-submitted until their work is on disk.

One coordinator drives one run name: preprocess parts as flow runs of
``splitflow-preprocess-part/<name>`` (the preprocess pool), then finalize here, then training
as a run of ``splitflow-train/<name>`` (the train pool).  It runs in the caller's process
(``splitflow run --preprocess-pool P --train-pool T``) or in the ``splitflow-coordinate``
deployment on a light control pool, never holding a GPU pool's slot.

Rules (docs/orchestration.md):

* **Disk decides.** What is left comes from ``stages.status.work_left``; a run that Prefect
  calls Completed but whose work is not on disk is re-submitted; one that Crashed after its
  work was written counts as done.
* **Classified failures.** A stage run's Failed state carries ``[splitflow:<kind>]``
  (flows/observe.py): input and terminal failures stop the coordinator at once, with the
  stage's one line; retryable ones, crashes and lost runs are re-submitted after
  ``retry_delay_s * 2**(attempt-1)`` seconds, up to the stage's ``retries``.
* **Lost runs.** A Running run whose heartbeat has not moved for ``stale_after_s`` of
  reachable API (a Pending one: 5x that) is marked Crashed and re-submitted: a SIGKILLed worker or
  a vanished node leaves no one else to say so.  A re-submitted part encodes only what is
  missing; a re-submitted training resumes from its last checkpoint.
* **Outages.** API calls failing for longer than ``api_grace_s`` end the coordinator with
  one line (exit 3); work on disk is kept, and the next run reconciles the runs the outage
  left unfinished (Completed when their work is on disk, adopted otherwise).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from diffsynth_core.errors import EnvironmentFailure
from stages import preprocess
from stages.config import RunConfig
from stages.status import WorkLeft, disk_state, stage_done, summary_from_disk, work_left

from ._prefect import PrefectApi, is_outage
from .observe import failure_error, parse_failure, run_tags, stage_label

log = logging.getLogger(__name__)
DEPLOYMENT_FLOWS = {"preprocess": "splitflow-preprocess-part", "train": "splitflow-train"}
_UNREACHABLE = object()
STARTING_FACTOR = 5  # a Pending run is a process starting (pulling code, importing): no heartbeat yet


@dataclass
class Job:
    """One stage's work (a preprocess part, or training) and its current flow run."""

    stage: str
    part: int | None = None
    run_id: object = None
    attempt: int = 0
    seen: tuple | None = None       # last (state, state time, heartbeat) observed
    changed_at: float = field(default_factory=time.monotonic)


class ApiGuard:
    """Calls the Prefect API; tolerates it being unreachable for up to ``grace_s`` seconds."""

    def __init__(self, grace_s: float, where: str, disk_state):
        self.grace_s, self.where, self.disk_state = grace_s, where, disk_state
        self.down_since: float | None = None
        self.reachable_since = time.monotonic()

    def call(self, fn, *args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- only outages are absorbed; the rest re-raised
            if not is_outage(err):
                raise
            now = time.monotonic()
            self.down_since = self.down_since or now
            if now - self.down_since > self.grace_s:
                raise EnvironmentFailure(
                    f"Prefect API at {self.where} unreachable for {now - self.down_since:.0f} s "
                    f"(orchestration.api_grace_s = {self.grace_s:g}): stopped waiting. Work on disk is kept "
                    f"({self.disk_state()}); stage runs already on workers go on. Re-run the same command "
                    "once the server is back.") from None
            return _UNREACHABLE
        if self.down_since is not None:
            log.info("Prefect API back after %.0f s", time.monotonic() - self.down_since)
            self.down_since, self.reachable_since = None, time.monotonic()
        return result

    def wait(self, fn, *args, poll_s: float = 1.0, **kwargs):
        """Like ``call`` but keep trying (within the grace period) until the API answers."""
        while (result := self.call(fn, *args, **kwargs)) is _UNREACHABLE:
            time.sleep(poll_s)
        return result


class Coordinator:
    def __init__(self, cfg: RunConfig, config: str | None, overrides: list[str], name: str,
                 stages: tuple[str, ...] = ("preprocess", "train"), parent_id=None, api_url: str = "?"):
        self.cfg, self.config, self.overrides, self.name = cfg, config, list(overrides), name
        self.stages, self.parent_id = stages, parent_id
        self.session = str(parent_id or uuid.uuid4())
        self.policy = cfg.orchestration
        self.guard = ApiGuard(self.policy.api_grace_s, api_url, lambda: disk_state(cfg))
        self.adopted: dict[tuple, object] = {}
        self.runs: dict[str, str] = {}
        self.api = PrefectApi()

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        # The client's own retries would hide an outage for a minute per call: the guard decides.
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1}):
            try:
                final = self._run_stages()
            finally:
                self.api.close()
        return self.summary(final)

    def _run_stages(self):
        """Reconcile, then preprocess parts (and finalize here), then training; returns finalize's summary."""
        left = work_left(self.cfg)
        self.reconcile(left)
        final = None
        if "preprocess" in self.stages and left.preprocess:
            self._drive([Job("preprocess", part) for part in left.parts])
            final = preprocess.finalize(self.cfg)
            log.info("%s: cache %s complete=%s, %d bad rows skipped", self.name, final.url,
                     final.complete, len(final.skipped))
            left = work_left(self.cfg)  # the parts are on disk now
        if "train" in self.stages and left.train:
            self._drive([Job("train")])
        return final

    def summary(self, final=None) -> dict:
        summary = summary_from_disk(self.cfg)
        if final is not None:
            summary["preprocess"] = final.as_dict()
        return {**summary, "runs": dict(self.runs)}

    # -- reconciliation --------------------------------------------------------------------------
    def reconcile(self, left: WorkLeft) -> None:
        """Close or adopt the runs of this run name that an earlier coordinator left unfinished."""
        for run in self.guard.wait(self.api.unfinished_runs, [f"run:{self.name}"]):
            tags = dict(tag.split(":", 1) for tag in run.tags if ":" in tag)
            stage, part = tags.get("stage"), int(tags["part"]) if "part" in tags else None
            if run.id == self.parent_id or stage not in ("preprocess", "train", "coordinate"):
                continue
            done = left.nothing if stage == "coordinate" else stage_done(self.cfg, stage, part, left)
            if done:
                self.guard.wait(self.api.set_state, run.id, "completed", "work found complete on disk")
                log.info("%s: run %s (%s) marked Completed: its work is on disk", self.name, run.name,
                         run.state.type.value)
            elif stage in self.stages:
                self.adopted[(stage, part)] = (run.id, int(tags.get("attempt", 1)))

    # -- driving jobs ----------------------------------------------------------------------------
    def _drive(self, jobs: list[Job]) -> None:
        for job in jobs:
            adopted = self.adopted.pop((job.stage, job.part), None)
            if adopted:
                job.run_id, job.attempt = adopted
                log.info("%s: waiting for the existing run of %s", self.name, self._label(job))
            else:
                self._submit(job, delay_s=0.0)
        pending = list(jobs)
        try:
            while pending:
                time.sleep(self.policy.poll_s)
                pending = [job for job in pending if not self._settle(job)]
        except Exception:
            self._cancel_waiting(pending)  # failing at once: runs not yet started need not start
            raise

    def _cancel_waiting(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                if self.api.read_run(job.run_id).state.is_scheduled():
                    self.api.set_state(job.run_id, "cancelled", "another stage run of this run failed")
            except Exception:  # noqa: BLE001 -- best effort while already failing
                pass

    def _label(self, job: Job) -> str:
        return stage_label(self.name, job.stage, job.part, self.cfg.preprocess.parts)

    def _retries(self, job: Job) -> int:
        return self.cfg.preprocess.retries if job.stage == "preprocess" else self.cfg.train.retries

    def _submit(self, job: Job, delay_s: float) -> None:
        job.attempt += 1
        label = self._label(job)
        name = label if job.attempt == 1 else f"{label} (attempt {job.attempt})"
        parameters = {"config": self.config, "overrides": self.overrides, "name": self.name}
        if job.part is not None:
            parameters["part"] = job.part
        tags = run_tags(self.cfg, self.name, job.stage, job.part) + [f"attempt:{job.attempt}"]
        key = f"{self.session}:{job.stage}:{job.part}:{job.attempt}"
        deployment = f"{DEPLOYMENT_FLOWS[job.stage]}/{self.name}"
        job.run_id = self.guard.wait(self.api.submit, deployment, parameters, name, tags, delay_s, key)
        job.seen, job.changed_at = None, time.monotonic()
        self.runs[name] = str(job.run_id)

    def _settle(self, job: Job) -> bool:
        """Look at a job's run once; True when its work is done."""
        run = self.guard.call(self.api.read_run, job.run_id)
        if run is _UNREACHABLE:
            return False
        state, label = run.state, self._label(job)
        if state.is_completed():
            if self._done_on_disk(job):
                log.info("%s: completed", label)
                return True
            return self._again(job, "retryable", "completed, but its work is not on disk")
        if state.is_failed() or state.is_crashed():
            kind, line = parse_failure(state.message)
            if kind in ("input", "terminal"):
                raise failure_error(kind, f"{label}: {line}")
            return self._done_on_disk(job) or self._again(job, kind, line)
        if state.is_cancelled():
            raise EnvironmentFailure(f"{label} was cancelled ({state.message}); re-run to continue",
                                     retryable=False)
        if (state.is_running() or state.is_pending()) and self._stale(job, run, state.is_pending()):
            if self._done_on_disk(job):
                self.guard.call(self.api.set_state, job.run_id, "completed", "work found complete on disk")
                return True
            self.guard.call(self.api.set_state, job.run_id, "crashed",
                            f"no heartbeat for {self.policy.stale_after_s:g} s: presumed lost (worker or node gone)")
            return self._again(job, "crashed", "lost: no heartbeat")
        return False  # scheduled or late: waiting for a worker of the pool

    def _stale(self, job: Job, run, starting: bool) -> bool:
        """No sign of life for ``stale_after_s`` of reachable API (5x while a worker starts the process)."""
        beat = self.guard.call(self.api.last_beat, job.run_id)
        if beat is _UNREACHABLE:
            return False
        seen = (run.state.type, run.state.timestamp, beat)
        if seen != job.seen:
            job.seen, job.changed_at = seen, time.monotonic()
        quiet_since = max(job.changed_at, self.guard.reachable_since)
        limit = self.policy.stale_after_s * (STARTING_FACTOR if starting else 1)
        return time.monotonic() - quiet_since > limit

    def _done_on_disk(self, job: Job) -> bool:
        return stage_done(self.cfg, job.stage, job.part)

    def _again(self, job: Job, kind: str, line: str) -> bool:
        label = self._label(job)
        if job.attempt > self._retries(job):
            raise EnvironmentFailure(f"{label} failed {job.attempt} times (last: {kind}: {line}); work on disk "
                                     "is kept: re-run to continue")
        delay = self.policy.retry_delay_s * 2 ** (job.attempt - 1)
        log.warning("%s: attempt %d %s (%s); re-submitting in %.0f s", label, job.attempt, kind, line, delay)
        self._submit(job, delay)
        return False
