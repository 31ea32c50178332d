"""Which cache entries a config needs: derived from its own dataset and settings, never from the cache.

Each row is keyed by content (its fields, its files' bytes, the decode settings, the encoders'
identity).  A config trains on its rows' keys in row order: identical rows stay repeats of one
entry (users duplicate rows to up-weight them), and rows that preprocessing skipped as bad are
left out only when ``dataset.skip_bad_samples`` is on, the rule preprocessing used.  So
configs sharing a cache each train on exactly their entries, and a partial cache or an edited
metadata file is caught before any training step.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from cache_store import AUX_PREFIX, IncompleteCacheError, entry_key, fingerprint_of, open_cache
from cache_store.opener import check_identity
from diffsynth_core.data import SampleDataset
from diffsynth_core.errors import InputError
from diffsynth_core.models import FamilySpec, check_model_folder

from .common import encoder_identity, family_of
from .config import RunConfig
from .datasets import open_dataset
from .encoding import row_key_settings
from .secrets import storage_options

log = logging.getLogger(__name__)
_ENCODER_FINGERPRINT = re.compile(r"^[0-9a-f]{32}$")  # what fingerprint_of gives; imports name their origin


# The encoder component that turns pixels into latents; every other encoder component is prompt-side.
PIXEL_COMPONENTS = ("vae",)


@dataclass
class Plan:
    """What a config needs from the cache, row by row.

    A row trains on two entries: its *target latents* (``latent_keys``: keyed by the target file's
    bytes, its decode settings and the VAE, so every config over the same image with the same VAE
    shares it) and its *conditioning* (``keys``: the prompt embedding and the reference latents, keyed
    by the row's fields, its reference files, the text encoder, the variant and the latents key).
    ``keys`` are the row keys everything else counts (training order, skips, status)."""

    spec: FamilySpec
    dataset: SampleDataset
    keys: dict[int, str]  # row -> conditioning key, for the rows this plan covers, in row order
    fingerprint: str      # the cache's identity: the family and its VAE (one latent space per cache)
    tiles: dict[int, int] = field(default_factory=dict)  # row -> VAE tile, for the rows encoded in tiles
    latent_keys: dict[int, str] = field(default_factory=dict)  # row -> target-latents key
    text_fingerprint: str = ""      # the prompt side: text encoder files, the variant (template)
    encoders_fingerprint: str = ""  # every encoder file: one loaded set per value (stages.encoding.POOL)
    # row -> its own empty-prompt entry (``row_empty_prompt_key``): the rows with references of a family whose
    # dropped caption keeps them (``ReferenceRule.empty_prompt_with_references``), when caption dropout is on
    empty_keys: dict[int, str] = field(default_factory=dict)

    def latents_of(self) -> dict[str, str]:
        """Conditioning key -> its target-latents key (what training reads beside each row's entry)."""
        return {self.keys[row]: self.latent_keys[row] for row in self.keys}


def identities(cfg: RunConfig, spec: FamilySpec) -> tuple[dict, dict, dict]:
    """(every encoder, the pixel side, the prompt side) identities of a config's encoders."""
    identity = encoder_identity(cfg, spec)
    components = identity["components"]
    pixels = {"family": spec.name, "components": {k: v for k, v in components.items() if k in PIXEL_COMPONENTS}}
    text = {"family": spec.name, "variant": spec.prompt_template or spec.variant,
            "components": {k: v for k, v in components.items() if k not in PIXEL_COMPONENTS}}
    return identity, pixels, text


def part_of(dataset, row: int, parts: int) -> int:
    """The preprocess part that encodes ``row``: a row's repeats (dataset.sources) go to the part of
    its first occurrence, so concurrent parts never encode one entry twice."""
    first_row = getattr(dataset, "first_row", None)
    return (first_row(row) if first_row else row) % parts


def make_plan(cfg: RunConfig, part: int | None = None) -> Plan:
    """Key rows by content: their fields and file bytes, the decode settings, the encoders.

    With ``part`` only that part's rows are keyed: hashing file bytes reads the whole part, so
    each writer reads its own rows and not the dataset.  (File digests are remembered across
    runs, so keying a dataset again costs a stat per file.)
    """
    spec = family_of(cfg)
    check_model_folder(spec, cfg.model.path)
    dataset = open_dataset(cfg.dataset, spec)
    identity, pixel_identity, text_identity = identities(cfg, spec)
    pixel_encoding = {"dtype": cfg.model.dtype, "vae": pixel_identity}
    prompt_encoding = {"max_sequence_length": cfg.preprocess.max_sequence_length, "dtype": cfg.model.dtype,
                       "text": text_identity}
    own_empty = (cfg.train.caption_dropout > 0 and spec.references is not None
                 and spec.references.empty_prompt_with_references)
    rows = range(len(dataset.records))
    if part is not None:
        rows = [row for row in rows if part_of(dataset, row, cfg.preprocess.parts) == part]
    keys, latent_keys, tiles, empty_keys = {}, {}, {}, {}
    for row in rows:
        files = dataset.source_files(row)  # the target's, then each reference's
        settings = dataset.key_settings(row)  # reads an image's header: once per row, here
        tiled = row_key_settings(cfg, spec, settings)  # the VAE tile, if any
        latent_keys[row] = entry_key(dataset.target_fields(row), files[:1], {**settings, **pixel_encoding, **tiled})
        conditioning = {**dataset.reference_settings(row), **prompt_encoding, "latents": latent_keys[row]}
        if len(files) > 1:  # reference latents: the VAE too (already in the latents key, stated for readers)
            conditioning["vae"] = pixel_identity
        keys[row] = entry_key(dataset.records[row], files[1:], conditioning)
        if own_empty and len(files) > 1:
            blank = {**dataset.records[row], dataset.prompt_column_of(row): ""}
            empty_keys[row] = row_empty_prompt_key(blank, files[1:], conditioning)
        if tiled:  # encoding uses the tile its key records
            tiles[row] = tiled["vae_tile"]
    return Plan(spec, dataset, keys, fingerprint_of(pixel_identity), tiles, latent_keys,
                fingerprint_of(text_identity), fingerprint_of(identity), empty_keys)


def empty_prompt_key(cfg: RunConfig, encoder_fingerprint: str) -> str:
    """Cache key of the empty prompt's embedding (caption dropout): one per text encoder (``Plan.text_fingerprint``;
    an imported cache's fingerprint) and prompt settings.
    An auxiliary entry (``AUX_PREFIX``): stored once per cache, in no config's training keys."""
    settings = {"empty_prompt": True, "encoders": encoder_fingerprint, "dtype": cfg.model.dtype,
                "max_sequence_length": cfg.preprocess.max_sequence_length}
    return f"{AUX_PREFIX}empty-prompt.{fingerprint_of(settings)}"


def row_empty_prompt_key(fields: dict, reference_files: list, conditioning: dict) -> str:
    """Cache key of a row's own empty prompt, encoded with its references (``Plan.empty_keys``): keyed as the
    row's conditioning entry with its prompt emptied (rows differing only in their prompts share it).
    An auxiliary entry: no training key; it holds only the prompt-side tensors, the row's entry its references."""
    return f"{AUX_PREFIX}empty-prompt.{entry_key(fields, reference_files, conditioning)}"


@dataclass
class Needs:
    """What a config needs from a cache, row by row."""

    train: list[str] = field(default_factory=list)         # keys to train on, row order, repeats kept
    latents: dict[str, str] = field(default_factory=dict)  # each train key -> its target-latents key
    missing: dict[int, str] = field(default_factory=dict)  # row -> key without an entry
    skipped: list[dict] = field(default_factory=list)      # bad rows left out (skip on), one per key
    rows: int = 0
    empty: dict[str, str] = field(default_factory=dict)          # train key -> its own empty prompt (Plan.empty_keys)
    empty_missing: dict[int, str] = field(default_factory=dict)  # row -> own empty prompt without an entry

    @property
    def complete(self) -> bool:
        return not self.missing and not self.empty_missing


def needs(plan: Plan, store, skip_bad_samples: bool, known_skips: list[dict] = ()) -> Needs:
    """Sort the plan's rows into present, skipped as bad (only when skipping is on) and missing.

    ``known_skips``: skip records the caller holds besides those committed in the cache.
    """
    recorded = {item["key"]: dict(item) for item in known_skips}
    recorded.update({k: {"key": k, **v} for k, v in store.skipped().items() if k not in recorded})
    result = Needs(rows=len(plan.keys))
    skipped: dict[str, dict] = {}
    for row, key in plan.keys.items():
        if store.has(key) and store.has(plan.latent_keys[row]):
            result.train.append(key)
            result.latents[key] = plan.latent_keys[row]
            empty = plan.empty_keys.get(row)
            if empty is not None and store.has(empty):
                result.empty[key] = empty
            elif empty is not None:
                result.empty_missing[row] = empty
        elif skip_bad_samples and key in recorded:
            skipped.setdefault(key, recorded[key])
        else:
            result.missing[row] = key
    result.skipped = list(skipped.values())
    return result


def _missing_message(url: str, plan: Plan, found: Needs, store, skip_bad_samples: bool) -> str:
    row, key = next(iter(found.missing.items()))
    text = (f"cache {url}: {len(found.missing)} of {found.rows} rows this config trains on are missing "
            f"(first: data row {row + 1} of {plan.dataset.metadata_path}, key {key})")
    bad = store.skipped().get(key)
    if bad and not skip_bad_samples:
        text += (f"; that row was skipped as bad by preprocess ({bad.get('reason')}): fix it, or set "
                 "dataset.skip_bad_samples = true")
    else:
        text += "; run `splitflow preprocess CONFIG` (every part), or set cache.allow_partial = true"
    if store.bad_parts:
        text += f" ({len(store.bad_parts)} unreadable manifests: run `splitflow cache verify`)"
    return text


def is_imported(store) -> bool:
    """An imported cache (e.g. from DiffSynth) names its origin instead of an encoder fingerprint."""
    return store.fingerprint is not None and not _ENCODER_FINGERPRINT.match(store.fingerprint)


def _open(cfg: RunConfig):
    return open_cache(cfg.cache_url, mode="r", storage_options=storage_options(cfg.cache))


def check_cache(cfg: RunConfig, store) -> Plan | None:
    """Check ``store`` was encoded by this config's model; return the plan (None: imported cache).

    Refuses (exit code 2, naming both sides) a cache of another family or other encoder weights.
    Imported caches carry no encoder identity: only their family (if recorded) can be checked.
    """
    check_identity(store.url, (store.fingerprint, store.family), None, cfg.model.family)  # cheap: first
    if is_imported(store):
        return None
    plan = make_plan(cfg)
    check_identity(store.url, (store.fingerprint, store.family), plan.fingerprint, plan.spec.name)
    return plan


@dataclass
class TrainingSet:
    store: object
    keys: list[str]                     # the rows' entries, in training order
    latents: dict[str, str] | None      # each key -> its target-latents entry; None: entries hold their latents
    plan: Plan | None                   # None: an imported cache
    empty: dict[str, str] = field(default_factory=dict)          # key -> its own empty prompt (Needs.empty)
    empty_missing: dict[int, str] = field(default_factory=dict)  # row -> its own empty prompt, not in the cache


def training_keys(cfg: RunConfig) -> tuple[object, list[str]]:
    """The checked cache and the keys to train on (``training_set``)."""
    found = training_set(cfg)
    return found.store, found.keys


def training_set(cfg: RunConfig) -> TrainingSet:
    """The checked cache and what to train on; refuses a cache lacking rows of this config.

    A partial cache is accepted with ``cache.allow_partial`` (a warning says how partial).
    """
    store = _open(cfg)
    plan = check_cache(cfg, store)
    if plan is None:
        log.warning("cache %s was imported (%s): its encoders cannot be checked against %s; training on "
                    "the keys recorded at import", store.url, store.fingerprint, cfg.model.path)
        return TrainingSet(store, imported_training_keys(cfg, store), None, None)
    found = needs(plan, store, cfg.dataset.skip_bad_samples)
    if found.missing and not cfg.cache.allow_partial:
        raise IncompleteCacheError(_missing_message(store.url, plan, found, store, cfg.dataset.skip_bad_samples))
    if found.missing:
        log.warning("cache.allow_partial: training on %d of %d rows (%d have no entry)",
                    len(found.train), found.rows, len(found.missing))
    if not found.train:
        raise IncompleteCacheError(f"cache {store.url} holds none of the {found.rows} rows this config "
                                   "trains on; run `splitflow preprocess CONFIG`")
    return TrainingSet(store, found.train, found.latents, plan, found.empty, found.empty_missing)


def imported_training_keys(cfg: RunConfig, store, spec: FamilySpec | None = None) -> list[str]:
    """An imported cache's keys to train on (those recorded at import).  Its edit rows (reference latents)
    train only a model that takes that many references: a text-to-image DiT would train on them as extra
    image tokens, with no error.  Shapes come from the cache's manifest; no tensor is read."""
    keys = store.require_complete(allow_partial=cfg.cache.allow_partial)
    spec = spec or family_of(cfg)
    rule = spec.references
    for key in keys:
        count = sum(name.startswith("ref_latents_") for name in store.shapes(key))
        allowed = 0 if rule is None else (rule.max_count if rule.max_count is not None else count)
        if count > allowed:
            source = (store.get(key).get("meta") or {}).get("source", key)
            model = f"{spec.name} ({spec.variant})" if spec.variant else spec.name
            raise InputError(f"cache {store.url}: {source} holds {count} reference latents (an edit row) but "
                             f"{model} takes {allowed}; set model.variant (or model.path) to the edit model the "
                             "cache was made for")
    return keys


def completeness(store, found: Needs | None) -> dict:
    """How complete ``store`` is for a config (``needs`` of its plan; None: an imported cache), in rows:
    what ``splitflow status`` shows."""
    if found is None:
        wanted, missing = store.dataset_keys() or store.keys(), store.missing_keys()
        return {"expected": len(wanted), "present": len(wanted) - len(missing), "missing": len(missing),
                "skipped": 0, "complete": not missing}
    return {"expected": len(found.train) + len(found.missing), "present": len(found.train),
            "missing": len(found.missing), "skipped": len(found.skipped), "complete": found.complete}
