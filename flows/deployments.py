"""Deployments: the stages as flow runs on work pools, and their coordinator on a light pool.

``deploy`` registers, for one run name (``--name`` or the config's name, so configs coexist):

* ``splitflow-preprocess-part/<name>`` on the preprocess pool (one part per run),
* ``splitflow-train/<name>`` on the train pool,
* ``splitflow-coordinate/<name>`` on the control pool (created if missing): the parent that
  drives the others (flows/coordinator.py).  It never occupies a GPU pool's slot, so a pool
  limit of 1 (one GPU) cannot deadlock it.

Every flow takes the config's path or URL and ``--set`` overrides as parameters (defaults: the
deployed config), never its content: one deployment serves later edits, and no
``cache.storage_options`` value reaches the API.  Each stage run reports progress (its
heartbeat) and ends Failed with a ``[splitflow:<kind>]`` record the coordinator reads.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from prefect import flow

from stages import preprocess as preprocess_stage
from stages import train as train_stage
from stages.config import RunConfig

# Absolute imports: a worker loads this file by its path, as a module named ``deployments``, and relative
# imports made a second copy of flows/ named ``deployments.*``, whose loggers no run forwarded.
from flows import _prefect as api
from flows.artifacts import part_table, train_report
from flows.heartbeat import part_heartbeat, train_heartbeat
from flows.observe import failure_state, forwarded_logs
from flows.runconfig import load_run_config

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/deployments.py"
CONTROL_POOL = "splitflow-control"


@flow(name="splitflow-preprocess-part")
def preprocess_part_flow(config: str | None = None, overrides: list[str] | None = None, part: int = 0,
                         name: str = "splitflow"):
    """Encode one part of the dataset into the cache (what is already there is reused)."""
    try:
        cfg = load_run_config(config, overrides)
        with forwarded_logs(), part_heartbeat(cfg, name, part):
            summary = preprocess_stage.run(cfg, part)
            part_table(name, summary)
        return summary.as_dict()
    except Exception as exc:  # noqa: BLE001 -- the failure record tells the coordinator what to do
        return failure_state(exc)


@flow(name="splitflow-train")
def train_stage_flow(config: str | None = None, overrides: list[str] | None = None, name: str = "splitflow"):
    """Train from the cache, resuming from the last checkpoint; progress, summary and images as artifacts."""
    try:
        cfg = load_run_config(config, overrides)
        with forwarded_logs(), train_heartbeat(cfg, name):
            summary = train_stage.run(cfg)
            train_report(name, cfg, summary)
        return summary.as_dict()
    except Exception as exc:  # noqa: BLE001
        return failure_state(exc)


@flow(name="splitflow-coordinate", flow_run_name="{name}")
def coordinate_flow(config: str | None = None, overrides: list[str] | None = None, name: str = "splitflow",
                    stages: list[str] | None = None):
    """Drive the stage runs of ``name`` on their pools until the work is on disk (flows/coordinator.py)."""
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL

    from flows.coordinator import Coordinator

    try:
        cfg = load_run_config(config, overrides)
        with forwarded_logs():
            coordinator = Coordinator(cfg, config, list(overrides or []), name,
                                      tuple(stages or ("preprocess", "train")),
                                      parent_id=FlowRunContext.get().flow_run.id, api_url=PREFECT_API_URL.value())
            return coordinator.run()
    except Exception as exc:  # noqa: BLE001
        return failure_state(exc)


def deploy(cfg: RunConfig, config: str | None, overrides: list[str], name: str, pools: dict[str, str],
           control_pool: str | None = CONTROL_POOL) -> dict:
    """Register run ``name``'s deployments on ``pools`` (stage -> pool) and the control pool.

    ``cfg`` is the config ``config`` and ``overrides`` load (the caller's, not loaded again).
    Pools that do not exist are created (type process); the caller sets their limits.
    """
    from flows.observe import base_tags

    parameters = {"config": config, "overrides": list(overrides), "name": name}
    plan = [(flow_of, pools[stage], {**parameters, "part": 0} if stage == "preprocess" else parameters)
            for stage, flow_of in (("preprocess", preprocess_part_flow), ("train", train_stage_flow))
            if pools.get(stage)]
    if control_pool:
        plan.append((coordinate_flow, control_pool, parameters))
    created = [pool for pool in dict.fromkeys(p for _, p, _ in plan) if api.ensure_process_pool(pool)]
    deployed = {}
    for stage_flow, pool, defaults in plan:
        source = flow.from_source(source=str(PROJECT_ROOT), entrypoint=f"{ENTRYPOINT}:{stage_flow.fn.__name__}")
        # Runs inherit these tags; the coordinator adds each stage run's own (stage, part, attempt).
        tags = base_tags(cfg, name) + (["stage:coordinate"] if stage_flow is coordinate_flow else [])
        with contextlib.redirect_stdout(io.StringIO()):  # Prefect prints a table; the CLI prints JSON
            deployment_id = source.deploy(name=name, work_pool_name=pool, parameters=defaults, tags=tags,
                                          description=f"splitflow run {name}: {config}", print_next_steps=False,
                                          ignore_warnings=True)
        deployed[f"{stage_flow.name}/{name}"] = str(deployment_id)
    trigger = f"prefect deployment run {coordinate_flow.name}/{name} --flow-run-name {name}" if control_pool else None
    return {"name": name, "config": config, "deployments": deployed, "pools_created": created,
            "pools": {**pools, "control": control_pool}, "trigger": trigger}
