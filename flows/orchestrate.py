"""How a verb runs its stages: decide from disk, then Prefect on this machine or on work pools.

``orchestrate`` is what ``splitflow run|preprocess|train|resume`` do after loading the config:
with nothing left to do it answers from disk without Prefect; otherwise ``prefect_session``
points Prefect at ``PREFECT_API_URL`` or a private server (flows/server.py), and the stages run
as flows in this process (flows/split_training.py) or as stage runs on work pools driven from
this process (flows/coordinator.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from diffsynth_core.errors import EnvironmentFailure
from stages.config import ConfigError, RunConfig
from stages.status import CacheView, check_resume_on_disk, disk_state, read_cache, summary_from_disk, work_left

from .local_runs import OutageWatch, close_left_open_now
from .runconfig import check_overrides
from .server import ApiSession, configured_api_url


def orchestrate(cfg: RunConfig, ref: str | None, overrides: list[str], name: str, stages: tuple[str, ...],
                pools: dict[str, str | None], debug: bool = False, verb: str = "run") -> dict:
    """Run ``stages`` for ``cfg``: in this process, or on work pools when pools are given.

    What is left is decided from disk first; with nothing left (and no pools) the answer comes
    without Prefect, unless ``PREFECT_API_URL`` names a server: runs an ended verb left open
    there are closed first (flows/local_runs.py).  Otherwise Prefect talks to that server or a
    private one.
    """
    pooled = [stage for stage in stages if pools.get(stage)]
    if pooled and len(pooled) != len(stages):
        raise ConfigError(f"give a pool for every stage this verb runs ({', '.join(stages)}) or none")
    url = configured_api_url()  # before PREFECT_HOME moves: the user's profile may name their server
    check_overrides(overrides)  # overrides become run parameters: no credentials there
    if pooled:
        check_lora_targets_first(cfg, stages, local=False)
        if "train" in stages:  # what may not change on resume: refused before any stage run is submitted
            _refuse_fixed_changes(cfg)
        with prefect_session(cfg, url, True, debug) as session:
            return _on_pools(cfg, ref, overrides, name, stages, pools, session.url)
    view = read_cache(cfg)  # decided from disk, before Prefect is imported or a server started
    if "train" in stages:  # the resume rule, before any model loads (a finished output told apart)
        check_resume_on_disk(cfg, view)
    left = work_left(cfg, view)
    if not (left.preprocess or ("train" in stages and left.train)):
        summary = idle_summary(cfg, stages, view)
        if url:  # the server may hold runs of this name that a killed or cut-off verb left Running
            prefect_environment(cfg.output_dir)
            return _with_closed(summary, close_left_open_now(cfg, name, left, url))
        return summary
    if left.train:
        check_lora_targets_first(cfg, stages, local=True)
    with prefect_session(cfg, url, False, debug) as session:
        from prefect import tags

        from .observe import process_tag, run_tags
        from .split_training import split_training

        closed = close_left_open_now(cfg, name, left, session.url)
        watch = OutageWatch(cfg, stages, session.url, verb, on_exit=session.close)
        with tags(*run_tags(cfg, name, "local"), process_tag()), _outage_as_one_line(cfg, session.url), watch:
            return _with_closed(split_training(ref, overrides, name, stages), closed)


def _with_closed(summary: dict, closed: str | None) -> dict:
    return {**summary, "reconciled": closed} if closed else summary


def check_lora_targets_first(cfg: RunConfig, stages: tuple[str, ...], local: bool) -> None:
    """A LoRA target naming no Linear of the DiT is one line now, not after a server start and a retry
    (``local=False``: the stages run on work pools, see ``stages.common.check_lora_targets``)."""
    if "train" not in stages:
        return
    from diffsynth_core.errors import InputError
    from stages.common import check_lora_targets, family_of

    try:
        spec = family_of(cfg)
    except InputError:
        if local:
            raise
        return  # the model is where the workers are: their load names what is missing or ambiguous
    check_lora_targets(cfg, spec, local)


def _refuse_fixed_changes(cfg: RunConfig) -> None:
    from diffsynth_core.training.checkpoint import CheckpointManager
    from stages.resume_rule import refuse_fixed_changes

    checkpoints = CheckpointManager(cfg.output_dir / "checkpoints")
    refuse_fixed_changes(cfg, checkpoints.latest_metadata(), str(checkpoints.latest_dir()))


@contextlib.contextmanager
def _outage_as_one_line(cfg: RunConfig, url: str):
    """The Prefect API lost under the flows (its client retried for about the grace period): say so."""
    from ._prefect import api_lost

    try:
        yield
    except Exception as err:
        if not api_lost(err, url):
            raise
        raise EnvironmentFailure(
            f"Prefect API at {url} unreachable (its client gave up after about orchestration.api_grace_s = "
            f"{cfg.orchestration.api_grace_s:g} s): stopped. Work on disk is kept ({disk_state(cfg)}); re-run "
            "the same command once the server is back.") from err


def client_retries(grace_s: float) -> int:
    """Prefect's client backs off 2, 4, 8... s between retries: enough retries to span ``grace_s``."""
    retries, waited = 0, 0.0
    while waited < grace_s:
        retries += 1
        waited += 2 ** retries
    return retries


def prefect_environment(output: Path) -> Path:
    """Keep Prefect's state out of $HOME (in the output folder, created now) unless PREFECT_HOME is set."""
    home = Path(os.environ.setdefault("PREFECT_HOME", str(output.resolve() / ".prefect")))
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    return home


def idle_summary(cfg: RunConfig, stages: tuple[str, ...], view: CacheView | None = None) -> dict:
    """What a verb with nothing left to do reports: the outcome on disk, nothing encoded or trained now."""
    summary = summary_from_disk(cfg, view)
    summary["preprocess"].update(encoded=0, reused=summary["preprocess"]["entries"])
    summary["train"]["resumed_from"] = summary["train"]["steps"]
    done = "the cache is complete" + (" and training finished" if "train" in stages else "")
    return {**summary, "note": f"nothing left to do: {done}"}


@contextlib.contextmanager
def prefect_session(cfg: RunConfig, url: str | None, shared: bool, debug: bool):
    """Prefect pointed at ``url`` (or a private server started now), quiet console, logs flushed at the end."""
    session = ApiSession(url, prefect_environment(cfg.output_dir), shared, cfg.orchestration.api_grace_s)
    try:
        session.start()  # the server boots while Prefect and the flows are imported
        from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        from .observe import console, flush_run_logs

        console(private_server=session.server is not None, debug=debug, api_url=session.url)
        retries = client_retries(cfg.orchestration.api_grace_s)  # an outage is waited out for the grace period
        with temporary_settings(updates={PREFECT_API_URL: session.ready(), PREFECT_CLIENT_MAX_RETRIES: retries}):
            try:
                yield session
            finally:
                flush_run_logs()
    finally:
        session.close()


def _on_pools(cfg, ref, overrides, name, stages, pools, url) -> dict:
    import logging

    from .coordinator import Coordinator
    from .deployments import deploy

    logging.getLogger("flows").setLevel(logging.INFO)  # the coordinator's progress lines on the console
    deploy(cfg, ref, overrides, name, {stage: pools[stage] for stage in stages}, control_pool=None)
    return Coordinator(cfg, ref, overrides, name, stages, api_url=url).run()
