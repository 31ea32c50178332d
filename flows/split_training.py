"""Prefect flows of the CLI path: both stages in this process (``splitflow run CONFIG``).

``split_training`` runs ``<name>/preprocess`` (one task per part, parts concurrently, then
finalize) and ``<name>/train`` as sub-flows.  Flows receive the config's reference and
overrides, never a ``RunConfig`` (flows/runconfig.py).  Retries follow the error taxonomy: an
input error (a bad row, a bad config, an incompatible cache) fails at once and is never
retried; other failures retry with backoff.  Resumption comes from disk either way.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.tasks import exponential_backoff

from diffsynth_core.errors import EnvironmentFailure, is_retryable
from stages import preprocess as preprocess_stage
from stages import train as train_stage
from stages.config import RunConfig

from ._prefect import api_lost
from .artifacts import part_table, train_report
from .heartbeat import train_heartbeat
from .observe import forwarded_logs, stage_label
from .runconfig import load_run_config


def _retryable(task, task_run, state) -> bool:
    """Input errors never; nor a lost Prefect API (only the report failed; the CLI says so once)."""
    from prefect.settings import PREFECT_API_URL

    error = state.result(raise_on_failure=False)
    return is_retryable(error) and not api_lost(error, PREFECT_API_URL.value())


def _with_retries(stage_task, retries: int):
    return stage_task.with_options(retries=retries, retry_delay_seconds=exponential_backoff(backoff_factor=1),
                                   retry_condition_fn=_retryable)


@task(name="encode-part", task_run_name="{label}", cache_policy=NO_CACHE)
def encode_part(cfg: RunConfig, part: int, name: str, label: str) -> dict:
    summary = preprocess_stage.run(cfg, part)
    part_table(name, summary)
    return summary.as_dict()


@task(name="finalize-cache", cache_policy=NO_CACHE)
def finalize_cache(cfg: RunConfig) -> dict:
    return preprocess_stage.finalize(cfg).as_dict()  # skipped rows are read from the cache


def _raise_for(failed: list) -> None:
    """An input error is raised as is (its line names the row); otherwise say what to do."""
    errors = [state.result(raise_on_failure=False) for state in failed]
    for error in errors:
        if not is_retryable(error):
            raise error
    raise EnvironmentFailure(f"{len(errors)} preprocess part(s) failed after their retries (last: "
                             f"{type(errors[-1]).__name__}: {errors[-1]}); re-run to encode only what is missing")


@flow(name="splitflow-preprocess", flow_run_name="{name}/preprocess", task_runner=ThreadPoolTaskRunner(max_workers=4))
def preprocess_flow(config: str | None, overrides: list[str] | None = None, name: str = "splitflow") -> dict:
    """Encode every part (concurrently, each retried when a retry can help), then finalize."""
    started = time.perf_counter()
    cfg = load_run_config(config, overrides)
    encode = _with_retries(encode_part, cfg.preprocess.retries)
    parts = cfg.preprocess.parts
    futures = [encode.submit(cfg, part, name, stage_label(name, "preprocess", part, parts)) for part in range(parts)]
    for future in futures:
        future.wait()  # every part finishes or exhausts its retries before the run is judged
    failed = [future.state for future in futures if not future.state.is_completed()]
    if failed:
        _raise_for(failed)
    summaries = [future.result() for future in futures]
    final = finalize_cache(cfg)
    encoded = sum(summary["encoded"] for summary in summaries)
    get_run_logger().info("%s: cache %s, %d entries encoded now, complete=%s", name, final["url"], encoded,
                          final["complete"])
    return {**final, "encoded": encoded, "reused": sum(summary["reused"] for summary in summaries),
            "truncated": sum(summary["truncated"] for summary in summaries),
            "seconds": time.perf_counter() - started}  # the stage's wall time, every part included


@task(name="train", task_run_name="{name}/train", cache_policy=NO_CACHE)
def train_task(cfg: RunConfig, name: str) -> dict:
    with train_heartbeat(cfg, name):
        summary = train_stage.run(cfg)
    train_report(name, cfg, summary)
    return summary.as_dict()


@flow(name="splitflow-train-local", flow_run_name="{name}/train")
def train_flow(config: str | None, overrides: list[str] | None = None, name: str = "splitflow") -> dict:
    """Train from the cache; a retry resumes from the last checkpoint (input errors: never retried)."""
    cfg = load_run_config(config, overrides)
    return _with_retries(train_task, cfg.train.retries)(cfg, name)


@flow(name="splitflow-run", flow_run_name="{name}")
def split_training(config: str | None, overrides: list[str] | None = None, name: str = "splitflow",
                   stages: tuple[str, ...] = ("preprocess", "train")) -> dict:
    """preprocess -> train, in this process; each stage resumes from what is on disk."""
    with forwarded_logs():
        result = {}
        if "preprocess" in stages:
            result["preprocess"] = preprocess_flow(config, overrides, name)
        if "train" in stages:
            result["train"] = train_flow(config, overrides, name)
    return result
