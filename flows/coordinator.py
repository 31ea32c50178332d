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
* **Slots of runs nobody watches.** A stage run whose process, worker and coordinator are all
  gone holds its pool slot (Pending/Running) until someone says otherwise, and that may be no
  coordinator of its own run name.  So every coordinator (and ``splitflow status`` with a
  server) looks at all splitflow stage runs holding slots, and marks Crashed those whose last
  heartbeat is older than their own ``stale_after_s`` (:func:`free_lost_slots`).
* **Interrupts.** Ctrl-C or SIGTERM cancels the stage runs this coordinator queued that have not
  started, and says which; those already started go on (the next run adopts them).
* **Outages.** API calls failing for longer than ``api_grace_s`` end the coordinator with
  one line (exit 3); work on disk is kept, and the next run reconciles the runs the outage
  left unfinished (Completed when their work is on disk, adopted otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from diffsynth_core.errors import EnvironmentFailure, is_interrupt
from stages import preprocess
from stages.config import RunConfig
from stages.status import WorkLeft, disk_state, stage_done, summary_from_disk, work_left

from ._prefect import PrefectApi, is_outage
from .observe import (artifact_key, failure_error, failure_kind, forwarded_logs, parse_failure, process_gone,
                      process_tag, run_tags, stage_label, tag_values)
from .signals import deferred

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
    attempt: int = 0                # the number its run's name and tags carry: goes on across re-runs
    tries: int = 0                  # runs this coordinator submitted or adopted for it: what retries count
    seen: tuple | None = None       # last (state, state time, heartbeat) observed
    changed_at: float = field(default_factory=time.monotonic)


class ApiGuard:
    """Calls the Prefect API; tolerates it being unreachable for up to ``grace_s`` seconds."""

    def __init__(self, grace_s: float, where: str, disk_state):
        self.grace_s, self.where, self.disk_state = grace_s, where, disk_state
        self.down_since: float | None = None
        self.reachable_since = time.monotonic()
        self.back_at: float | None = None  # when the API came back after an outage this process saw

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
            self.back_at = self.reachable_since
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
        self.attempts: dict[tuple, int] = {}  # (stage, part) -> the highest attempt earlier runs used
        self.watched: set = set()              # the runs this coordinator judges itself (_settle)
        self.runs: dict[str, str] = {}
        self.api = PrefectApi()

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        # The client's own retries would hide an outage for a minute per call: the guard decides.
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 1}):
            try:
                with self._recorded():
                    final = self._run_stages()
            finally:
                self.api.close()
        return self.summary(final)

    @contextlib.contextmanager
    def _recorded(self):
        """The coordinator's own flow run, holding its log lines: the deployed flow's, or one opened here (CLI)."""
        if self.parent_id is not None:  # coordinate_flow: Prefect's engine keeps the run, forwarded_logs the lines
            yield
            return
        from .deployments import coordinate_flow

        parameters = {"config": self.config, "overrides": self.overrides, "name": self.name,
                      "stages": list(self.stages)}
        tags = run_tags(self.cfg, self.name, "coordinate") + [process_tag()]
        self.parent_id = self.guard.wait(self.api.open_run, coordinate_flow, self.name, parameters, tags)
        try:
            with forwarded_logs(self.parent_id):
                yield
        except BaseException as exc:
            if is_interrupt(exc):
                self._close_own_run("cancelled", "stopped by Ctrl-C or SIGTERM")
            else:
                kind, line = failure_kind(exc)
                self._close_own_run("failed", f"[splitflow:{kind}] {line}")
            raise
        self._close_own_run("completed", "work on disk")

    def _close_own_run(self, kind: str, message: str) -> None:
        if self.guard.down_since is not None:
            return  # the API is away: the next run of this name closes it (reconcile)
        api = PrefectApi()  # an interrupt may have cut a request of self.api short
        try:
            api.set_state(self.parent_id, kind, message)
        except Exception:  # noqa: BLE001 -- best effort: the work's outcome is already decided
            pass
        finally:
            api.close()

    def _run_stages(self):
        """Reconcile, then preprocess parts (and finalize here), then training; returns finalize's summary."""
        left = work_left(self.cfg)
        self.free_lost_slots()
        self.reconcile(left)
        final = None
        if "preprocess" in self.stages and left.preprocess:
            started = time.perf_counter()
            jobs = [Job("preprocess", part) for part in left.parts]
            self._drive(jobs)
            final = self._counted(preprocess.finalize(self.cfg), jobs, time.perf_counter() - started)
            log.info("%s: cache %s complete=%s, %d encoded now, %d bad rows skipped", self.name, final.url,
                     final.complete, final.encoded, len(final.skipped))
            left = work_left(self.cfg)  # the parts are on disk now
        if "train" in self.stages and left.train:
            self._drive([Job("train")])
        return final

    def _counted(self, final, jobs: list[Job], seconds: float):
        """Finalize's summary with what the parts encoded (their table artifacts) and the stage's wall time."""
        counts = Counter()
        for job in jobs:
            key = artifact_key(self.name, "preprocess", f"part-{job.part + 1}-of-{self.cfg.preprocess.parts}")
            rows = self.guard.call(self.api.table, job.run_id, key)
            for row in rows if isinstance(rows, list) else ():  # none: its work was found on disk
                counts[row["outcome"]] += row["rows"] if row["outcome"] in ("encoded", "truncated") else 0
        return dataclasses.replace(final, encoded=counts["encoded"], reused=max(0, final.reused - counts["encoded"]),
                                   truncated=counts["truncated"], seconds=round(seconds, 2))

    def summary(self, final=None) -> dict:
        summary = summary_from_disk(self.cfg)
        if final is not None:
            summary["preprocess"] = final.as_dict()
        return {**summary, "runs": dict(self.runs)}

    # -- other runs: lost slots, reconciliation ----------------------------------------------------
    def free_lost_slots(self) -> None:
        lines = self.guard.call(free_lost_slots, self.api, self.policy.stale_after_s, self.watched,
                                self.guard.back_at)
        for line in lines if isinstance(lines, list) else ():
            log.warning("%s", line)

    def reconcile(self, left: WorkLeft) -> None:
        """Close or adopt the runs of this run name that an earlier coordinator left unfinished."""
        for run in self.guard.wait(self.api.recent_runs, [f"run:{self.name}"]):
            tags = tag_values(run.tags)
            key = (tags.get("stage"), int(tags["part"]) if "part" in tags else None)
            self.attempts[key] = max(self.attempts.get(key, 0), int(tags.get("attempt", 0)))
        for run in self.guard.wait(self.api.unfinished_runs, [f"run:{self.name}"]):
            tags = tag_values(run.tags)
            stage, part = tags.get("stage"), int(tags["part"]) if "part" in tags else None
            if run.id == self.parent_id or stage not in ("preprocess", "train", "coordinate"):
                continue
            done = left.nothing if stage == "coordinate" else stage_done(self.cfg, stage, part, left)
            if done:
                self.guard.wait(self.api.set_state, run.id, "completed", "work found complete on disk")
                log.info("%s: run %s (%s) marked Completed: its work is on disk", self.name, run.name,
                         run.state.type.value)
            elif stage == "coordinate" and process_gone(run.tags):  # a CLI coordinator killed, or cut off
                self.guard.wait(self.api.set_state, run.id, "crashed", "its process is gone; "
                                f"run {self.parent_id} took over")
                log.info("%s: run %s marked Crashed: its coordinator is gone", self.name, run.name)
            elif stage in self.stages:
                self.adopted[(stage, part)] = (run.id, int(tags.get("attempt", 1)))

    # -- driving jobs ----------------------------------------------------------------------------
    def _drive(self, jobs: list[Job]) -> None:
        pending = list(jobs)
        try:
            for job in jobs:
                job.attempt = self.attempts.get((job.stage, job.part), 0)
                adopted = self.adopted.pop((job.stage, job.part), None)
                if adopted:
                    (job.run_id, job.attempt), job.tries = adopted, 1
                    self.watched.add(job.run_id)
                    log.info("%s: waiting for the existing run of %s", self.name, self._label(job))
                else:
                    self._submit(job, delay_s=0.0)
            while pending:
                time.sleep(self.policy.poll_s)
                self.free_lost_slots()
                pending = [job for job in pending if not self._settle(job)]
        except BaseException as stop:
            self._withdraw(pending, stop)  # failing or stopped at once: runs not yet started need not start
            raise

    def _withdraw(self, jobs: list[Job], stop: BaseException) -> None:
        """Cancel the runs of ``jobs`` still waiting for a worker; on an interrupt, say which (and which go on)."""
        if self.guard.down_since is not None:
            return  # the API is away: the next run of this name adopts what is queued
        interrupted = is_interrupt(stop)
        why = "its coordinator was stopped (Ctrl-C or SIGTERM)" if interrupted else "another stage run failed"
        cancelled, going_on = [], []
        api = PrefectApi()  # the interrupt may have cut a request of self.api short
        with deferred():  # a second Ctrl-C must not leave half of them queued
            for job in (job for job in jobs if job.run_id is not None):
                try:
                    (cancelled if api.cancel_if_scheduled(job.run_id, why) else going_on).append(self._label(job))
                except Exception:  # noqa: BLE001 -- best effort while already failing (the API may be away)
                    going_on.append(self._label(job))
            api.close()
        if interrupted:
            log.warning("%s: stopped: cancelled %s%s", self.name,
                        ", ".join(cancelled) or "no queued stage run",
                        f"; already started, left to finish: {', '.join(going_on)}" if going_on else "")

    def _label(self, job: Job) -> str:
        return stage_label(self.name, job.stage, job.part, self.cfg.preprocess.parts)

    def _retries(self, job: Job) -> int:
        return self.cfg.preprocess.retries if job.stage == "preprocess" else self.cfg.train.retries

    def _submit(self, job: Job, delay_s: float) -> None:
        job.attempt, job.tries = job.attempt + 1, job.tries + 1
        label = self._label(job)
        name = label if job.attempt == 1 else f"{label} (attempt {job.attempt})"
        parameters = {"config": self.config, "overrides": self.overrides, "name": self.name}
        if job.part is not None:
            parameters["part"] = job.part
        # Its own stale_after_s travels with it: whoever finds it silent that long may free its slot.
        tags = run_tags(self.cfg, self.name, job.stage, job.part) + [
            f"attempt:{job.attempt}", f"stale_after_s:{self.policy.stale_after_s:g}"]
        key = f"{self.session}:{job.stage}:{job.part}:{job.attempt}"
        deployment = f"{DEPLOYMENT_FLOWS[job.stage]}/{self.name}"
        job.run_id = self.guard.wait(self.api.submit, deployment, parameters, name, tags, delay_s, key)
        job.seen, job.changed_at = None, time.monotonic()
        self.watched.add(job.run_id)
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
        if job.tries > self._retries(job):
            raise EnvironmentFailure(f"{label} failed {job.tries} times (last: {kind}: {line}); work on disk "
                                     "is kept: re-run to continue")
        delay = self.policy.retry_delay_s * 2 ** (job.tries - 1)
        log.warning("%s: attempt %d %s (%s); re-submitting in %.0f s", label, job.attempt, kind, line, delay)
        self._submit(job, delay)
        return False


def free_lost_slots(api: PrefectApi, stale_after_s: float, watched=frozenset(),
                    back_at: float | None = None) -> list[str]:
    """Mark Crashed every splitflow stage run that holds a pool slot with no heartbeat past its stale time.

    Each run's own ``stale_after_s`` tag decides (``stale_after_s``: for runs without one); a Pending
    run (a worker starting its process) gets ``STARTING_FACTOR`` times that.  Heartbeats are the
    server's times, compared with this machine's clock, as Prefect compares its own.  ``back_at``:
    when this process saw the API come back from an outage (no run could beat meanwhile).
    ``watched``: runs the caller judges itself.  Returns one line per run marked.
    """
    runs = [run for run in api.slot_holders(["splitflow"]) if run.id not in watched and run.work_pool_name
            and tag_values(run.tags).get("stage") in DEPLOYMENT_FLOWS]
    beats = api.last_beats([run.id for run in runs]) if runs else {}
    lines = []
    for run in runs:
        limit = float(tag_values(run.tags).get("stale_after_s", stale_after_s))
        limit *= STARTING_FACTOR if run.state.is_pending() else 1
        last = max(run.state.timestamp.timestamp(), beats[run.id].timestamp() if run.id in beats else 0.0)
        quiet = time.time() - last
        if back_at is not None:
            quiet = min(quiet, time.monotonic() - back_at)
        if quiet <= limit:
            continue
        api.set_state(run.id, "crashed", f"no heartbeat for {quiet:.0f} s (stale after {limit:g} s): presumed "
                                         "lost (its process, worker and coordinator gone); slot freed")
        lines.append(f"{run.name}: no heartbeat for {quiet:.0f} s (stale after {limit:g} s): marked Crashed, its "
                     f"slot on pool {run.work_pool_name} freed; it resumes from disk when its config runs again")
    return lines


def free_lost_slots_now(stale_after_s: float, url: str) -> dict:
    """:func:`free_lost_slots` once, as ``splitflow status`` asks it of a server: ``{"api", "freed"}``."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from .server import api_healthy

    if not api_healthy(url):
        return {"api": url, "reachable": False}
    api = PrefectApi()
    try:
        with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_CLIENT_MAX_RETRIES: 1}):
            return {"api": url, "reachable": True, "freed": free_lost_slots(api, stale_after_s)}
    finally:
        api.close()
