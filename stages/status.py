"""What is done for a config, and what is left: read from disk only (the cache and the checkpoints).

"Prefect coordinates, disk decides": the CLI's no-op check, the pool coordinator and the run
reconciliation after an outage all ask :func:`work_left` (and :func:`stage_done`), never a
Prefect result, so a retry, a re-submission or a lost server can never change an outcome.
Which rows a config needs comes from ``stages.keys`` (derived from the config itself).
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cache_store import CacheFormatError, open_cache
from diffsynth_core.errors import InputError
from diffsynth_core.training.checkpoint import CheckpointManager

from .config import RunConfig
from .keys import Needs, Plan, check_cache, completeness, empty_prompt_key, make_plan, needs, part_of
from .resume_rule import check_resume, refuse_fixed_changes
from .secrets import storage_options
from .train import final_exports, planned_total


def _open_existing(cfg: RunConfig):
    """``(store, None)`` for reading, or ``(None, why)`` when the cache is not written yet."""
    try:
        return open_cache(cfg.cache_url, mode="r", storage_options=storage_options(cfg.cache)), None
    except (FileNotFoundError, CacheFormatError) as err:  # not written yet, or not a cache
        return None, str(err)


@dataclass
class CacheView:
    """The cache read once for a config: what every answer below is derived from (a verb that asks
    several questions reads the dataset and the cache once, not once per question)."""

    store: Any = None                # None: not written yet (``note`` says why)
    note: str | None = None
    plan: Plan | None = None         # None with a store: an imported cache (no rows to key)
    found: Needs | None = None
    error: InputError | None = None  # the cache does not fit the config, or the config's data cannot be read


def read_cache(cfg: RunConfig) -> CacheView:
    store, note = _open_existing(cfg)
    if store is None:
        return CacheView(note=note)
    try:
        plan = check_cache(cfg, store)
    except InputError as err:  # other encoders, or the config's dataset/model cannot be read
        return CacheView(store, error=err)
    found = needs(plan, store, cfg.dataset.skip_bad_samples) if plan is not None else None
    return CacheView(store, plan=plan, found=found)


def _cache_status(cfg: RunConfig, view: CacheView) -> dict:
    """Whether the cache holds every row *this* config trains on (derived from the config)."""
    unknown = {"url": cfg.cache_url, "expected": None, "present": 0, "complete": False}
    if view.store is None:
        return {**unknown, "exists": False, "note": view.note}
    if view.error is not None:
        return {**unknown, "exists": True, "note": str(view.error)}
    return {"url": cfg.cache_url, "exists": True, **completeness(view.store, view.found)}


def metric_rows(cfg: RunConfig) -> list[dict]:
    """The rows of ``metrics.csv`` (step, epoch, loss, ...), one per optimizer step so far."""
    path = cfg.output_dir / "metrics.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def last_metrics(cfg: RunConfig) -> dict | None:
    rows = metric_rows(cfg)
    return rows[-1] if rows else None


def _loss_at(rows: list[dict], step: int) -> float | None:
    """The loss logged at ``step``: steps logged after the last checkpoint (an interrupted run's) are
    trained again on resume, so the checkpoint's own step is the one that counts."""
    kept = [row for row in rows if int(row["step"]) <= step]
    return float(kept[-1]["loss"]) if kept else None


def _train_status(cfg: RunConfig) -> dict:
    checkpoints = CheckpointManager(cfg.output_dir / "checkpoints")
    latest, step = checkpoints.latest_dir(), checkpoints.latest_step()
    exports = sorted(str(p) for p in Path(cfg.output_dir).glob("*.safetensors"))
    return {"output": str(cfg.output_dir), "step": step, "max_steps": cfg.train.max_steps,
            "latest_checkpoint": str(latest) if latest else None, "exports": exports,
            "last_loss": _loss_at(metric_rows(cfg), step)}


def run_status(cfg: RunConfig, view: CacheView | None = None) -> dict:
    return {"cache": _cache_status(cfg, view or read_cache(cfg)), "train": _train_status(cfg)}


def disk_state(cfg: RunConfig) -> str:
    """What is on disk, in a few words (for a message saying the work so far is kept)."""
    status = run_status(cfg)
    cache, train = status["cache"], status["train"]
    expected = cache.get("expected")
    return (f"cache {cache['present']}/{expected if expected is not None else '?'} entries, "
            f"training at step {train['step']}")


def summary_from_disk(cfg: RunConfig, view: CacheView | None = None) -> dict:
    """A run's outcome as the stages' summaries name it, read from the cache and the output folder."""
    cache, train = _cache_status(cfg, view or read_cache(cfg)), _train_status(cfg)
    return {"preprocess": {"url": cache["url"], "complete": cache["complete"], "entries": cache["present"],
                           "expected": cache["expected"], "skipped": cache.get("skipped", 0)},
            "train": {"output": train["output"], "steps": train["step"], "final_loss": train["last_loss"],
                      "exports": train["exports"]}}


@dataclass
class WorkLeft:
    """What a run of ``cfg`` still has to do, derived from the cache and the checkpoints."""

    parts: list[int] = field(default_factory=list)  # preprocess parts with rows neither cached nor skipped
    train_steps: int = 0        # optimizer steps left (unknown while rows are missing: >= 1)
    total_steps: int = 0        # 0 while rows are missing
    export: bool = True         # the final export is missing or older than the last checkpoint

    @property
    def preprocess(self) -> bool:
        return bool(self.parts)

    @property
    def train(self) -> bool:
        return self.train_steps > 0 or self.export

    @property
    def nothing(self) -> bool:
        return not self.preprocess and not self.train

    def as_dict(self) -> dict:
        out = {**asdict(self), "nothing": self.nothing}
        if self.parts:  # steps follow from the encoded rows (batches of a shape): not known yet
            out.update(total_steps=None, note="total_steps is counted once every part is encoded")
        return out


def _rows_left(cfg: RunConfig, view: CacheView) -> tuple[list[int], list[str]]:
    """``(parts with rows to encode, keys training takes)`` of a cache that fits the config."""
    store, plan = view.store, view.plan
    if plan is None:  # an imported cache: nothing to encode, train on what it records
        return [], store.dataset_keys() or store.keys()
    rows = [*view.found.missing, *view.found.empty_missing]  # rows without their entry, or their own empty prompt
    parts = {part_of(plan.dataset, row, cfg.preprocess.parts) for row in rows}
    if not store.has(empty_prompt_key(cfg, plan.text_fingerprint)):
        parts.add(0)  # part 0 encodes the empty prompt (caption dropout) once per cache
    return sorted(parts), view.found.train


def work_left(cfg: RunConfig, view: CacheView | None = None) -> WorkLeft:
    """Which parts still need encoding and how many training steps remain (0 and exported: done).

    Total steps follow the loop's rule (``planned_steps``) for one process; a finished run
    trained under torchrun with ``max_steps`` unset may look unfinished here.
    """
    view = view or read_cache(cfg)
    if view.store is None:
        return WorkLeft(parts=list(range(cfg.preprocess.parts)), train_steps=1)
    if view.error is not None:  # another model's cache, or unreadable data: the verb reports it
        raise view.error
    parts, keys = _rows_left(cfg, view)
    if parts:
        return WorkLeft(parts=parts, train_steps=1)
    total = planned_total(cfg, view.store, keys, latents=_latents_of(view))
    checkpoints = CheckpointManager(cfg.output_dir / "checkpoints")
    step, latest = checkpoints.latest_step(), checkpoints.latest_dir()
    exported = latest is not None and all(
        path.is_file() and path.stat().st_mtime >= (latest / "state.pt").stat().st_mtime for path in final_exports(cfg))
    return WorkLeft(parts=[], train_steps=max(0, total - step), total_steps=total, export=not exported)


def _latents_of(view: CacheView) -> dict[str, str] | None:
    """Training key -> its target-latents entry, where the cache keeps them apart (``stages.keys``)."""
    return view.found.latents if view.found is not None else None


def check_resume_on_disk(cfg: RunConfig, view: CacheView | None = None) -> None:
    """The resume rule (``stages.resume_rule``) for the output's latest checkpoint, before any stage runs:
    what may not change always; a finished output given another config once the cache is complete.
    Notices of what changes are left to the training stage, which says them once."""
    checkpoints = CheckpointManager(cfg.output_dir / "checkpoints")
    metadata = checkpoints.latest_metadata()
    if metadata is None:
        return
    where = str(checkpoints.latest_dir())
    view = view or read_cache(cfg)
    parts, keys = _rows_left(cfg, view) if view.store is not None and view.error is None else ([0], [])
    if parts:  # rows to encode first: the training stage checks the rest once they are in
        refuse_fixed_changes(cfg, metadata, where)
        return
    total = planned_total(cfg, view.store, keys, latents=_latents_of(view))
    check_resume(cfg, metadata, where, total, keys, notice=False)


def stage_done(cfg: RunConfig, stage: str, part: int | None = None, left: WorkLeft | None = None) -> bool:
    """Whether a stage run's work is on disk: a preprocess part (all its rows cached or skipped), or training."""
    left = left or work_left(cfg)
    if stage == "preprocess":
        return part not in left.parts if part is not None else not left.parts
    return not left.preprocess and not left.train


def part_keys(cfg: RunConfig, part: int) -> set[str]:
    """The cache keys of one preprocess part's rows (keying reads the dataset: do it once per part)."""
    return set(make_plan(cfg, part).keys.values())


def part_progress(cfg: RunConfig, keys: set[str]) -> tuple[int, int]:
    """``(rows done, rows)`` of one preprocess part (its ``part_keys``): cached or recorded as skipped."""
    store, _ = _open_existing(cfg)
    if store is None:
        return 0, len(keys)
    return len(keys & (set(store.keys()) | set(store.skipped()))), len(keys)


def train_progress(cfg: RunConfig) -> tuple[int, float | None]:
    """``(steps done, last loss)`` from ``metrics.csv``."""
    last = last_metrics(cfg)
    return (int(last["step"]) if last else 0), (float(last["loss"]) if last else None)
