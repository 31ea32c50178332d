"""Heartbeats: a running stage's progress artifact, updated from disk every ``orchestration.heartbeat_s``.

The progress (rows cached, steps done) is what a Prefect user watches; the artifact's
``updated`` time is what the coordinator reads to tell a live stage run from a lost one
(flows/coordinator.py): a SIGKILLed worker leaves a run Running that no longer beats.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
from typing import Callable

from stages.config import RunConfig

from .observe import artifact_key, stage_label


class Heartbeat:
    """Update a progress artifact every ``interval`` seconds from ``progress()`` (a percentage).

    ``progress`` reads the disk (cache entries, metrics.csv); failures (API down, a file being
    replaced) are skipped, never raised: the beat must not disturb the stage it reports on.
    """

    def __init__(self, key: str, description: str, progress: Callable[[], float], interval: float):
        self.key, self.description, self.progress, self.interval = key, description, progress, interval
        self.value = 0.0
        self._stop = threading.Event()
        # The thread runs in a copy of this run's context, so the artifact belongs to this run.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._loop,), name="splitflow-heartbeat",
                                        daemon=True)
        self.artifact_id = None

    def _post(self) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(self.value, key=self.key, description=self.description)
        else:
            update_progress_artifact(self.artifact_id, progress=self.value)

    def _measure(self) -> None:
        self.value = max(0.0, min(100.0, float(self.progress())))

    def _loop(self) -> None:
        # Post first, measure after: a slow measurement (a busy disk) must not delay the beat.
        while True:
            for step in (self._post, self._measure):
                try:
                    step()
                except Exception as err:  # noqa: BLE001 -- reporting must never fail the stage
                    logging.getLogger(__name__).debug("heartbeat skipped: %s", err)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)
        try:
            self._measure()  # the final value (100 % when the stage finished)
            self._post()
        except Exception:  # noqa: BLE001
            pass


def _percent(done: int, total: int) -> float:
    return 100.0 * done / total if total else 0.0


def part_heartbeat(cfg: RunConfig, name: str, part: int) -> Heartbeat:
    """Progress of one preprocess part: its rows cached or skipped, read from the cache."""
    from stages.status import part_keys, part_progress

    label = stage_label(name, "preprocess", part, cfg.preprocess.parts)
    keys = functools.cache(lambda: part_keys(cfg, part))  # keyed once, in the beat's thread; not every beat
    return Heartbeat(artifact_key(name, "preprocess-part", part + 1, "of", cfg.preprocess.parts, "progress"),
                     f"{label}: rows done", lambda: _percent(*part_progress(cfg, keys())),
                     cfg.orchestration.heartbeat_s)


def train_heartbeat(cfg: RunConfig, name: str) -> Heartbeat:
    """Progress of training from ``metrics.csv``; each new step also goes to the run's logs."""
    from prefect import get_run_logger

    from stages.status import work_left

    logger, label = get_run_logger(), stage_label(name, "train")
    seen = {"step": 0, "total": None}
    resumed = _ResumedSteps(cfg)

    def progress() -> float:
        if seen["total"] is None:  # once, in the beat's thread; max_steps spares reading the cache
            try:
                seen["total"] = cfg.train.max_steps or work_left(cfg).total_steps
            except Exception as err:  # noqa: BLE001 -- the stage reports it; the beat goes on
                logging.getLogger(__name__).debug("heartbeat: total steps unknown: %s", err)
        total = seen["total"] or 0  # unknown this beat: asked again at the next one
        step, loss = resumed.progress()
        if step != seen["step"]:
            seen["step"] = step
            of_total = f" of {total}" if total else ""
            logger.info("%s: step %d%s, loss %.4g", label, step, of_total, loss)
        return _percent(step, total)

    return Heartbeat(artifact_key(name, "train-progress"), f"{label}: steps done", progress,
                     cfg.orchestration.heartbeat_s)


class _ResumedSteps:
    """``(step, loss)`` of this attempt from ``metrics.csv``.

    A killed attempt's rows past its last checkpoint stay in the file until the resumed attempt
    reaches them (it trains them again): until this attempt writes the file, they are not its step.
    """

    def __init__(self, cfg: RunConfig):
        self.cfg, self.path = cfg, cfg.output_dir / "metrics.csv"
        self.stamp = self._stamp()

    def _stamp(self):
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def progress(self) -> tuple[int, float | None]:
        from diffsynth_core.training.checkpoint import CheckpointManager
        from stages.status import metric_rows, train_progress

        if self.stamp is None or self._stamp() != self.stamp:  # a fresh run, or this attempt has written
            return train_progress(self.cfg)
        resume = CheckpointManager(self.cfg.output_dir / "checkpoints").latest_step()
        kept = [row for row in metric_rows(self.cfg) if int(row["step"]) <= resume]
        return (int(kept[-1]["step"]), float(kept[-1]["loss"])) if kept else (0, None)
