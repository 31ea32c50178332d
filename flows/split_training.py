"""Prefect flows around the two stages: ``preprocess``, ``train`` and ``split_training``.

The flows hold no logic of their own: each task wraps one ``stages`` call.  Resumption is
derived from what is on disk (cache entries, checkpoints), so a retried or re-run flow
continues where the last one stopped; Prefect adds retries, fan-out and observability.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from stages import preprocess as preprocess_stage
from stages import train as train_stage
from stages.config import RunConfig


@task(name="encode-part", task_run_name="encode-part-{part}")
def encode_part(cfg: RunConfig, part: int) -> dict:
    return preprocess_stage.run(cfg, part).as_dict()


@task(name="finalize-cache")
def finalize_cache(cfg: RunConfig, skipped: list[dict]) -> dict:
    return preprocess_stage.finalize(cfg, skipped).as_dict()


@flow(name="preprocess", flow_run_name="preprocess-{cfg.model.family}-{cfg.preprocess.parts}parts",
      task_runner=ThreadPoolTaskRunner(max_workers=4))
def preprocess_flow(cfg: RunConfig) -> dict:
    """Encode every part (parts run concurrently, each retried on failure), then finalize."""
    logger = get_run_logger()
    encode = encode_part.with_options(retries=cfg.preprocess.retries, retry_delay_seconds=1)
    futures = encode.map(unmapped(cfg), range(cfg.preprocess.parts))
    futures.wait()  # let every part finish or exhaust its retries before judging
    failed = [part for part, future in enumerate(futures) if not future.state.is_completed()]
    if failed:
        raise RuntimeError(f"preprocess parts {failed} failed; re-run to encode only what is missing")
    summaries = futures.result()
    for summary in summaries:
        logger.info("part %s/%s: %s encoded, %s already cached, %s skipped", summary["part"] + 1,
                    summary["parts"], summary["encoded"], summary["reused"], len(summary["skipped"]))
    final = finalize_cache(cfg, [item for summary in summaries for item in summary["skipped"]])
    encoded = sum(summary["encoded"] for summary in summaries)
    if encoded == 0:
        logger.info("cache %s is complete: nothing to encode", final["url"])
    else:
        logger.info("cache %s: %s entries encoded, complete=%s", final["url"], encoded, final["complete"])
    return {**final, "encoded": encoded, "reused": sum(summary["reused"] for summary in summaries)}


@flow(name="train", flow_run_name="train-{cfg.model.family}")
def train_flow(cfg: RunConfig) -> dict:
    logger = get_run_logger()
    summary = train_stage.run(cfg)
    logger.info(summary.describe())
    return summary.as_dict()


@flow(name="split_training", flow_run_name="split-training-{cfg.model.family}")
def split_training(cfg: RunConfig) -> dict:
    """preprocess -> train; a failed train retries from its last checkpoint."""
    cache = preprocess_flow(cfg)
    trained = train_flow.with_options(retries=cfg.train.retries)(cfg)
    return {"preprocess": cache, "train": trained}
