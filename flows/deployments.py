"""Deployments: run the stages on work pools (cheap GPUs preprocess, a big GPU trains).

``deploy`` registers three deployments from this source tree on a running Prefect server
(``PREFECT_API_URL``): ``preprocess-part`` (one part per run, on the preprocess pool),
``train`` (on the train pool) and ``split-training-pools``, a thin parent that fans the parts
out over the preprocess pool, finalizes the cache and then starts training.  Each stage's
resumption comes from disk, so a re-run or a ``prefect flow-run retry`` continues the work.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger

from flows._prefect import result_or, start_run, wait_for_run
from stages import preprocess as preprocess_stage
from stages import train as train_stage
from stages.config import RunConfig
from diffsynth_core.errors import InputError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/deployments.py"


@flow(name="preprocess-part", flow_run_name="preprocess-part{part}of{cfg.preprocess.parts}")
def preprocess_part_flow(cfg: RunConfig, part: int) -> dict:
    return preprocess_stage.run(cfg, part).as_dict()


@flow(name="train-stage", flow_run_name="train-{cfg.model.family}")
def train_stage_flow(cfg: RunConfig) -> dict:
    return train_stage.run(cfg).as_dict()


@flow(name="split-training-pools")
def split_training_on_pools(cfg: RunConfig) -> dict:
    """Parent flow: parts on the preprocess pool (in parallel), then training on the train pool."""
    logger = get_run_logger()
    params = {"cfg": cfg.model_dump(mode="json")}
    run_ids = [start_run("preprocess-part/preprocess-part", {**params, "part": part})
               for part in range(cfg.preprocess.parts)]
    finished = [wait_for_run(run_id) for run_id in run_ids]
    failed = [part for part, run in enumerate(finished) if not run.state.is_completed()]
    if failed:
        raise RuntimeError(f"preprocess parts {failed} did not complete; re-run to encode only what is missing")
    final = preprocess_stage.finalize(cfg)  # skipped rows are recorded in the cache by each part
    logger.info("cache complete=%s (%s rows)", final.complete, final.rows)
    trained = wait_for_run(start_run("train-stage/train-stage", params))
    if not trained.state.is_completed():
        raise RuntimeError(f"training run {trained.id} ended {trained.state.type.value}; re-run to resume")
    return {"preprocess": final.as_dict(), "train": result_or(trained, {"id": str(trained.id)})}


def deploy(cfg: RunConfig, config_path: Path, preprocess_pool: str, train_pool: str) -> dict:
    if not os.environ.get("PREFECT_API_URL"):
        raise InputError("deploy needs a Prefect server: start one (prefect server start) and set PREFECT_API_URL")
    params = {"cfg": cfg.model_dump(mode="json")}
    plan = [("preprocess_part_flow", "preprocess-part", preprocess_pool, {**params, "part": 0}),
            ("train_stage_flow", "train-stage", train_pool, params),
            ("split_training_on_pools", "split-training-pools", train_pool, params)]
    deployed = {}
    for function, name, pool, parameters in plan:
        source = flow.from_source(source=str(PROJECT_ROOT), entrypoint=f"{ENTRYPOINT}:{function}")
        deployed[name] = str(source.deploy(name=name, work_pool_name=pool, parameters=parameters,
                                           description=f"splitflow {name} for {config_path}", print_next_steps=False))
    return {"config": str(config_path), "deployments": deployed,
            "pools": {"preprocess": preprocess_pool, "train": train_pool}}
