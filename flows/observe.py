"""What a Prefect user sees of a run: names, tags, the project's log lines, failure records.

* Names and tags: ``myrun/preprocess part 2 of 4``, ``myrun/train``; tags ``splitflow``,
  ``run:<name>``, ``family:<family>``, ``config:<hash>``, ``stage:<stage>`` (and ``part:<k>``).
  The config hash leaves ``cache.storage_options`` out: nothing derived from a secret is shown.
* Logs: the ``stages``, ``diffsynth_core`` and ``cache_store`` loggers reach the run's logs.
* Failure record: a stage run that fails returns a Failed state whose message starts with
  ``[splitflow:<kind>]`` (input | terminal | retryable | bug), so the coordinator, in another
  process, knows whether re-submitting can help without needing the exception or a result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import sys
from contextlib import contextmanager

from diffsynth_core.errors import EnvironmentFailure, InputError, Interrupted, classify
from stages.config import RunConfig

PROJECT_LOGGERS = ("stages", "diffsynth_core", "cache_store", "flows")
FAILURE_RE = re.compile(r"^\[splitflow:(input|terminal|retryable|bug)\] (.*)$", re.S)


# -- names and tags ----------------------------------------------------------------------------
def config_hash(cfg: RunConfig) -> str:
    data = cfg.model_dump(mode="json")
    data["cache"].pop("storage_options", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def stage_label(name: str, stage: str, part: int | None = None, parts: int | None = None) -> str:
    if stage == "preprocess" and part is not None:
        return f"{name}/preprocess part {part + 1} of {parts}"
    return f"{name}/{stage}"


def base_tags(cfg: RunConfig, name: str) -> list[str]:
    """The tags every run of ``name`` carries, deployments included (they serve later config edits: no hash)."""
    return ["splitflow", f"run:{name}", f"family:{cfg.model.family}"]


def run_tags(cfg: RunConfig, name: str, stage: str, part: int | None = None) -> list[str]:
    tags = base_tags(cfg, name) + [f"config:{config_hash(cfg)}", f"stage:{stage}"]
    return tags + ([f"part:{part}"] if part is not None else [])


def tag_values(tags) -> dict[str, str]:
    """``["stage:train", "part:1"]`` -> ``{"stage": "train", "part": "1"}`` (plain tags left out)."""
    return dict(tag.split(":", 1) for tag in tags if ":" in tag)


def process_tag() -> str:
    """``process:<host>:<pid>:<start ticks>``: the process that holds a run open without a worker (the CLI)."""
    from .server import _start_ticks

    return f"process:{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid())}"


def process_gone(tags) -> bool:
    """Whether a run's process tag names a process of this host that has ended (another host's: unknown, False)."""
    from .server import _alive

    host, _, rest = tag_values(tags).get("process", "").partition(":")
    pid, _, ticks = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return not _alive(int(pid), int(ticks) if ticks.isdigit() else None)


def artifact_key(name: str, *suffix: object) -> str:
    """Artifact keys hold lowercase letters, digits and dashes only (Prefect's rule)."""
    text = "-".join([name, *map(str, suffix)]).lower()
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text)).strip("-")


# -- logs --------------------------------------------------------------------------------------
class _RunIdFilter(logging.Filter):
    """Records from threads outside Prefect's run context (the heartbeat) still name the run."""

    def __init__(self, flow_run_id):
        super().__init__()
        self.flow_run_id = flow_run_id

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import get_run_context
        from prefect.exceptions import MissingContextError

        if not getattr(record, "flow_run_id", None):
            try:
                get_run_context()  # inside a flow or task run: Prefect names the run itself
            except MissingContextError:
                record.flow_run_id = self.flow_run_id
        return True


_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\r")


class _PlainText(logging.Filter):
    """A run's logs are read in a browser: no terminal escape codes (progress bars, colours) in them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _ESCAPES.search(message):
            record.msg, record.args = _ESCAPES.sub("", message), ()
        return True


@contextmanager
def forwarded_logs(flow_run_id=None):
    """Send the project's INFO+ log lines to a flow run's logs while inside: the current run's, or
    ``flow_run_id``'s (a run this process keeps itself, the CLI's coordinator run)."""
    from prefect.context import FlowRunContext
    from prefect.logging.handlers import APILogHandler

    context = FlowRunContext.get()
    handler = APILogHandler(level=logging.INFO)
    handler.addFilter(_RunIdFilter(flow_run_id or (context.flow_run.id if context and context.flow_run else None)))
    handler.addFilter(_PlainText())
    loggers = [logging.getLogger(name) for name in PROJECT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
        flush_run_logs()  # a stage run's last lines reach Prefect before its final state does


def flush_run_logs() -> None:
    """Send queued run logs now (Prefect batches them; a run's process may exit, or our server stop, first)."""
    if "prefect.logging.handlers" in sys.modules:
        from prefect.logging.handlers import APILogWorker

        try:
            APILogWorker.drain_all(timeout=5)
        except Exception:  # noqa: BLE001 -- the server may already be gone
            pass


# -- failure records ---------------------------------------------------------------------------
def failure_kind(exc: BaseException) -> tuple[str, str]:
    """``(kind, one line)`` of a failure: input and terminal ones are never re-submitted."""
    classified = classify(exc)
    if classified is None:
        return "bug", f"{type(exc).__name__}: {exc}"
    if isinstance(classified, Interrupted):  # on a worker: its machine or the worker was stopped, not the run
        return "retryable", f"{classified} (the worker was stopped)"
    if isinstance(classified, InputError):
        return "input", str(classified)
    return ("retryable" if classified.retryable else "terminal"), str(classified)


def failure_state(exc: BaseException):
    """A Failed state carrying the failure's kind; the traceback goes to the run's logs."""
    from prefect import get_run_logger
    from prefect.states import Failed

    kind, line = failure_kind(exc)
    get_run_logger().error("%s", line, exc_info=exc)
    return Failed(message=f"[splitflow:{kind}] {line}")


def parse_failure(message: str | None) -> tuple[str, str]:
    """``(kind, line)`` from a state message; runs that crashed carry no record: ``crashed``."""
    match = FAILURE_RE.match(message or "")
    return (match.group(1), match.group(2)) if match else ("crashed", message or "no message")


def failure_error(kind: str, line: str) -> Exception:
    """The taxonomy's exception for a failure record read back in the coordinator."""
    if kind == "input":
        return InputError(line)
    return EnvironmentFailure(line, retryable=kind not in ("terminal",))


# -- the CLI's console -------------------------------------------------------------------------
class _FailureEchoFilter(logging.Filter):
    """Drop console records that echo a failure the CLI reports in its own line.

    That is: records carrying an anticipated (input or environment) exception or a lost API,
    the engine's "Finished in state Failed(...)" lines, and Prefect's event plumbing (what it
    could not send while the API was away).  A bug's traceback stays on the console.
    """

    def __init__(self, private_server: bool, api_url: str | None = None):
        super().__init__()
        self.api_url = api_url  # an outage only when the API is down too (flows/_prefect.api_lost)
        self.echoes = ("Finished in state Failed", "Finished in state Crashed")
        if private_server:  # its links die with the verb
            self.echoes += ("View at http",)

    def filter(self, record: logging.LogRecord) -> bool:
        from ._prefect import api_lost

        if record.name.startswith(("prefect.events", "prefect._internal")):
            return False  # Prefect's event plumbing: events it could not send (an outage), not the run's story
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            return classify(exc) is None and not api_lost(exc, self.api_url)
        message = record.getMessage() if record.name.startswith(("prefect.flow_runs", "prefect.task_runs")) else ""
        return not message.startswith(self.echoes)


def console(private_server: bool = False, debug: bool = False, api_url: str | None = None) -> None:
    """Set up Prefect's console for a CLI verb: no echo of failures the verb reports in one line.

    The records still reach the run's logs (the API handler sits on other loggers), where a
    Prefect user looks for them; with ``--debug`` the console shows everything.
    """
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler, _SafeStreamHandler

    ensure_logging_setup()  # Prefect configures its handlers lazily
    if not debug:
        logging.raiseExceptions = False  # the stdlib's production setting: a record that cannot be sent is dropped
    # prefect._internal has a stream handler of its own: its services' errors during an outage ("EventsWorker")
    for logger in (logging.getLogger(), logging.getLogger("prefect"), logging.getLogger("prefect._internal")):
        for handler in logger.handlers:
            if isinstance(handler, (PrefectConsoleHandler, _SafeStreamHandler)):
                # One filter, this session's: an earlier verb in this process (tests, the demo) set its own.
                for old in [f for f in handler.filters if isinstance(f, _FailureEchoFilter)]:
                    handler.removeFilter(old)
                if not debug:
                    handler.addFilter(_FailureEchoFilter(private_server, api_url))
