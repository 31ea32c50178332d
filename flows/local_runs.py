"""The CLI path's runs on a Prefect server: a watch on the API while they run, and closing those a gone verb left open.

* **The outage watch.** The flows of ``splitflow run CONFIG`` report to the API through Prefect's
  client, which waits out a lost server for about ``api_grace_s`` per request, one request after
  another: minutes of retries.  :class:`OutageWatch` asks the API's health every second; once it
  has been away for ``api_grace_s`` it ends the verb in one line: exit 3 with what is on disk, or,
  when the disk says the work is done, exit 0 with the summary and a line that the server could
  not be told.  It ends the process at once (``os._exit``): every write of the stages is atomic,
  as safe as the SIGKILL they are built to survive, and the next run resumes.
* **Runs left open.** Every run of the CLI path carries ``process:<host>:<pid>:<ticks>``
  (``observe.process_tag``).  The next verb of the run name that reaches the server, whether or
  not work remains, marks those whose process has ended (:func:`close_left_open`): Completed when
  their work is on disk, Crashed otherwise.  A live verb's runs are never touched.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from diffsynth_core.errors import EXIT_ENVIRONMENT, EXIT_OK
from stages.config import RunConfig
from stages.status import WorkLeft, disk_state, stage_done, summary_from_disk, work_left

from .server import api_healthy

log = logging.getLogger(__name__)


def _work_done(cfg: RunConfig, stages: tuple[str, ...]) -> bool:
    try:
        left = work_left(cfg)
    except Exception:  # noqa: BLE001 -- unreadable now: not done, the next run says why
        return False
    return not left.preprocess and not ("train" in stages and left.train)


class OutageWatch:
    """While the CLI path's flows run: end the verb once the API at ``url`` has been away ``api_grace_s``."""

    def __init__(self, cfg: RunConfig, stages: tuple[str, ...], url: str, verb: str, on_exit=None,
                 interval_s: float = 1.0):
        self.cfg, self.stages, self.url, self.verb = cfg, stages, url, verb
        self.grace_s, self.interval_s, self.on_exit = cfg.orchestration.api_grace_s, interval_s, on_exit
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="splitflow-outage-watch", daemon=True)

    def __enter__(self) -> "OutageWatch":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._done.set()  # not joined: a health check in flight ends within seconds, and the thread is a daemon

    def _watch(self) -> None:
        down_since = None
        while not self._done.wait(self.interval_s):
            if api_healthy(self.url):  # its own 2 s timeout: a busy server is slow, not away
                down_since = None
            else:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since >= self.grace_s:
                    self._end(time.monotonic() - down_since)
                    return

    def _end(self, down_s: float) -> None:
        done = _work_done(self.cfg, self.stages)
        if self._done.is_set():
            return  # the flows finished meanwhile: the verb reports as usual
        where = f"Prefect API at {self.url}"
        if done:
            note = (f"the work is done ({disk_state(self.cfg)}), but the {where} has been unreachable for "
                    f"{down_s:.0f} s: its runs could not be told; the next run with the server back closes them")
            print(json.dumps({**summary_from_disk(self.cfg), "note": note}, indent=2, default=str))
            line, code = f"note: {note}", EXIT_OK
        else:
            line = (f"error: {where} unreachable for {down_s:.0f} s (orchestration.api_grace_s = {self.grace_s:g}): "
                    f"stopped. Work on disk is kept ({disk_state(self.cfg)}); re-run the same command once the "
                    "server is back")
            code = EXIT_ENVIRONMENT
        sys.stderr.write(f"\nsplitflow {self.verb}: {line}\n")  # a newline first: a progress bar may hold the line
        sys.stdout.flush()
        sys.stderr.flush()
        if self.on_exit is not None:
            try:
                self.on_exit()  # the private server, when it was ours that went away
            except Exception:  # noqa: BLE001 -- exiting anyway
                pass
        os._exit(code)


def _stage_of(name: str, run) -> str:
    """The stage whose work a run of ``name`` stands for: ``myrun/train`` (its flow or task runs) train; the
    parent ``myrun`` train, unless its verb ran preprocess alone; the rest of it preprocess."""
    if run.name == name:
        return "train" if "train" in (getattr(run, "parameters", None) or {}).get("stages", ["train"]) else "preprocess"
    return "train" if run.name.startswith(f"{name}/train") else "preprocess"


def close_left_open(api, cfg: RunConfig, name: str, left: WorkLeft) -> str | None:
    """Mark the CLI-path runs of ``name`` whose process has ended; one line saying so, or None."""
    from .observe import process_gone

    tags = [f"run:{name}", "stage:local"]
    flow_runs = [(run, api.set_state) for run in api.unfinished_runs(tags) if process_gone(run.tags)]
    task_runs = [(run, api.set_task_state) for run in api.unfinished_task_runs(tags) if process_gone(run.tags)]
    verdicts = []
    for run, set_state in flow_runs + task_runs:
        done = stage_done(cfg, _stage_of(name, run), left=left)
        set_state(run.id, "completed" if done else "crashed",
                  "work found complete on disk (its verb had ended)" if done else
                  "its verb ended without telling (killed, or it lost the Prefect server); the work resumes from disk")
        verdicts.append("Completed" if done else "Crashed")
    if not verdicts:
        return None
    counts = ", ".join(f"{verdicts.count(kind)} {kind}" for kind in ("Completed", "Crashed") if kind in verdicts)
    return f"{name}: closed {len(verdicts)} run(s) an ended verb left open ({counts}, as the disk says)"


def close_left_open_now(cfg: RunConfig, name: str, left: WorkLeft, url: str) -> str | None:
    """:func:`close_left_open` against ``url`` with one try per request: an unreachable API is said, not waited for."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from ._prefect import PrefectApi, is_outage

    if not api_healthy(url):
        return f"Prefect API at {url} unreachable: runs left open there are closed by the next run that reaches it"
    api = PrefectApi()
    try:
        with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_CLIENT_MAX_RETRIES: 1}):
            return close_left_open(api, cfg, name, left)
    except Exception as err:
        if not is_outage(err):
            raise
        return None
    finally:
        api.close()
