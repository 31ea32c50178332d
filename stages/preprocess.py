"""Stage 1: encode prompts and pixels into the cache, without gradients.

``run(cfg, part)`` encodes the rows of one part (row index modulo ``preprocess.parts``), or
every row when ``part`` is None, skipping entries the cache already holds; ``finalize``
reports whether the cache now holds every row this config needs (``stages.keys``: the
config, not the cache, says which).  One writer per part (a lock in the cache names it); a
killed run loses at most the entries since its last commit, and re-running resumes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from cache_store import open_cache

from .config import RunConfig
from .encoding import Encoded, encode_rows, release_encoders
from .keys import Plan, empty_prompt_key, make_plan, needs
from .locks import cache_part_lock
from .secrets import storage_options
from diffsynth_core.errors import InputError, naming_the_place

log = logging.getLogger(__name__)
PREPROCESS_CONFIG = "preprocess.toml"  # the config that encoded the cache, beside it in output.path


@dataclass
class CacheSummary:
    url: str
    part: int | None
    parts: int
    rows: int             # dataset rows this call was responsible for
    encoded: int          # rows encoded now (their prompt, references and, unless cached, target latents)
    reused: int           # rows already in the cache
    skipped: list[dict] = field(default_factory=list)  # bad rows skipped (skip_bad_samples)
    truncated: int = 0    # prompts encoded now that were longer than the text encoder keeps
    complete: bool = False
    seconds: float = 0.0
    # Of the rows encoded now: target latents encoded, and those reused from the cache (written for
    # another config over the same images and VAE, or for an identical target earlier in this dataset).
    latents_encoded: int = 0
    latents_reused: int = 0
    # Rows' own empty prompts encoded now, with their references (caption dropout: Plan.empty_keys).
    empty_prompts: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        scope = "all parts" if self.part is None else f"part {self.part + 1}/{self.parts}"
        text = f"preprocess ({scope}): {self.encoded} encoded, {self.reused} already cached"
        if self.skipped:
            text += f", {len(self.skipped)} bad rows skipped"
        if self.truncated:
            text += f", {self.truncated} prompts truncated"
        if self.empty_prompts:
            text += f", {self.empty_prompts} empty prompts with their rows' references (caption dropout)"
        if self.latents_reused:  # shared with another config over the same images (or a repeated target)
            text += f"; target latents: {self.latents_encoded} encoded, {self.latents_reused} reused"
        return text + f" in {self.seconds:.1f}s -> {self.url}"


def _open_store(cfg: RunConfig, plan: Plan, writer: str | None):
    return open_cache(cfg.cache_url, mode="a", backend=cfg.cache.backend, fingerprint=plan.fingerprint,
                      family=plan.spec.name, writer=writer, storage_options=storage_options(cfg.cache))


def _unique_rows(plan: Plan) -> list[int]:
    """The plan's rows, the first of each group of identical rows (they share one entry)."""
    first_row = {}
    for row, key in plan.keys.items():
        first_row.setdefault(key, row)
    return list(first_row.values())


def _report_truncated(truncated: list[tuple[int, int]], max_sequence_length: int | None) -> None:
    """One warning line naming the rows whose prompts the text encoder cut (data rows from 1).

    Raising ``preprocess.max_sequence_length`` helps only when it is what cut them: past the
    encoder's own limit (Qwen-Image's 1024 tokens) the pipeline keeps no more."""
    if truncated:
        kept = truncated[0][1]
        listed = ", ".join(str(row + 1) for row, _ in truncated[:10]) + (", ..." if len(truncated) > 10 else "")
        advice = ("shorten them or raise preprocess.max_sequence_length" if max_sequence_length == kept else
                  "shorten them: this is the text encoder's own limit, which preprocess.max_sequence_length "
                  "cannot raise")
        log.warning("%d prompt(s) are longer than the text encoder keeps (%d tokens) and were truncated: "
                    "data rows %s; %s", len(truncated), kept, listed, advice)


def run(cfg: RunConfig, part: int | None = None) -> CacheSummary:
    parts = cfg.preprocess.parts
    if part is not None and not 0 <= part < parts:
        raise InputError(f"part {part} out of range: preprocess.parts = {parts}")
    writer = "all" if part is None else f"part-{part}-of-{parts}"
    with cache_part_lock(cfg, writer) as lock:  # one writer per part: a second is refused, naming the first
        with naming_the_place("writing cache", cfg.cache_url):
            return _run_part(cfg, part, writer, lock)


def _run_part(cfg: RunConfig, part: int | None, writer: str, lock) -> CacheSummary:
    started = time.perf_counter()
    parts = cfg.preprocess.parts
    plan = make_plan(cfg, part)
    store = _open_store(cfg, plan, writer)
    store.commit_guard = lock.verify
    rows = _unique_rows(plan)
    todo = [row for row in rows if not (store.has(plan.keys[row]) and store.has(plan.latent_keys[row]))]
    summary = CacheSummary(store.url, part, parts, len(rows), 0, len(rows) - len(todo))
    # Rows cached without their own empty prompt (encoded with caption dropout off): only that is encoded.
    pending = set(todo)
    todo += [row for row in rows if row in plan.empty_keys and not store.has(plan.empty_keys[row]) and row not in pending]
    empty_key = empty_prompt_key(cfg, plan.text_fingerprint)
    if part not in (None, 0) or store.has(empty_key):
        empty_key = None  # part 0 (or the only writer) encodes it, once per cache
    if todo or empty_key:
        done = _encode_rows(cfg, plan, store, sorted(todo), part, empty_key)
        summary.encoded, summary.skipped, summary.truncated = done.rows, done.skipped, len(done.truncated)
        summary.latents_encoded, summary.latents_reused = done.latents, done.rows - done.latents
        summary.empty_prompts = done.empty_prompts
    if part is None:
        summary.complete = finalize(cfg, summary.skipped, plan=plan).complete
    summary.seconds = time.perf_counter() - started
    log.info(summary.describe())
    return summary


def _encode_rows(cfg: RunConfig, plan: Plan, store, rows: list[int], part: int | None,
                 empty_prompt_key: str | None = None) -> Encoded:
    done = encode_rows(cfg, plan, store, rows, part, empty_prompt_key)  # stages/encoding.py
    _report_truncated(done.truncated, cfg.preprocess.max_sequence_length)
    skipped_reasons = {row: (file, reason) for row, file, reason in plan.dataset.skipped}
    for item in done.skipped:
        item["file"], item["reason"] = skipped_reasons.get(item["row"], ("", ""))
        store.put_skipped(item["key"], item)  # on disk: finalize and training read it from the cache
    store.commit()
    return done


def finalize(cfg: RunConfig, skipped: list[dict] = (), plan: Plan | None = None) -> CacheSummary:
    """Whether the cache holds every row this config trains on (bad rows skipped excluded).

    Nothing is recorded: training derives the same answer from its config (``stages.keys``).
    Skipped rows are read from the cache (every writer records them there), so no result needs
    to travel from the parts to here; ``skipped`` adds rows known only to the caller.
    """
    release_encoders()  # this process's parts are done: give back GPU memory and pinned host copies
    plan = plan or make_plan(cfg)
    store = _open_store(cfg, plan, writer=None)
    found = needs(plan, store, cfg.dataset.skip_bad_samples, list(skipped))
    # Which dataset and encoders made this cache: a training step that names only the DiT
    # (DiffSynth's `--task sft:train`) reads them from here (stages/compat/diffsynth.py).
    cfg.save(cfg.output_dir / PREPROCESS_CONFIG)
    return CacheSummary(store.url, None, cfg.preprocess.parts, found.rows, 0, len(found.train),
                        found.skipped, complete=found.complete)
