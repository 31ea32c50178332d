"""Stage 1's encoding engine: encoders loaded once per process, samples encoded in batches.

* ``POOL`` keeps each process's loaded encoders, one set per (model, device, placement): every
  part and batch the process runs reuses them (a Prefect worker running parts one after another,
  or the parts the preprocess flow runs in threads).  Parts on one device share one set and take
  turns on it (``Encoders.lock``); ``release_encoders()`` frees the idle sets.
* ``encode_rows`` decodes rows in background threads (``stages.decoding``), groups them into
  batches of ``preprocess.batch_size`` samples of one shape, and encodes prompts and pixels a
  batch at a time: per row a conditioning entry (the prompt embedding, ``ref_latents_<i>`` of its
  references) and, unless the cache holds it, a target-latents entry (``stages.keys``).  Batched results equal one-at-a-time encoding up to the kernels' batch
  dependence (fp32 on CPU: within 1e-6; see docs/scaling.md); ``batch_size = 1`` is exact.
* ``part_device`` spreads parts over ``preprocess.devices``, one GPU per part.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from diffsynth_core.models import Components, FamilySpec
from diffsynth_core.models.encoders import enable_vae_tiling
from diffsynth_core.training.device import avoid_broken_kernels

from .common import load_components, model_dtype, resolve_device
from .config import RunConfig
from .decoding import decoded, shape_batches
from .encoder_memory import Placement, place_encoders, vae_tile

log = logging.getLogger(__name__)


# --- devices -------------------------------------------------------------------------------------

def preprocess_devices(cfg: RunConfig) -> list[str]:
    """The devices parts are spread over: ``preprocess.devices`` ("all" = every visible GPU), or
    ``preprocess.device`` alone when that is empty (or "all" finds no GPU)."""
    devices = cfg.preprocess.devices
    if devices == "all":
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return list(devices) or [cfg.preprocess.device]


def part_device(cfg: RunConfig, part: int | None) -> torch.device:
    """Part ``k`` runs on device ``k mod len(devices)``; the whole dataset (part None) on the first."""
    devices = preprocess_devices(cfg)
    key = "preprocess.devices" if cfg.preprocess.devices else "preprocess.device"
    return resolve_device(devices[(part or 0) % len(devices)], key)


# --- the encoders of one device ------------------------------------------------------------------

@dataclass(eq=False)
class Encoders:
    """A family's encoders placed on one device; one batch at a time (``lock``)."""

    spec: FamilySpec
    components: Components
    placement: Placement
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def device(self) -> torch.device:
        return self.placement.device

    def encode_prompts(self, prompts: list[str], options: dict, images: list[list] | None = None) -> list[dict]:
        """Prompts in as many text-encoder calls as the budget needs.

        ``images``: each prompt's reference images for a text encoder that sees them
        (``ReferenceRule.text_area``); None keeps the text-only call of families without references."""
        spec, device = self.spec, str(self.device)
        if spec.encode_prompts is None:
            return [spec.encode_prompt(self.components, p, device, **options,
                                       **({} if images is None else {"images": images[i]}))
                    for i, p in enumerate(prompts)]
        # Text tokens only: a VL prompt's image tokens come on top (prompt_lengths takes no images).
        lengths = spec.prompt_lengths(self.components, prompts, **options) if spec.prompt_lengths else [0] * len(prompts)
        out = []
        for start, stop in self.placement.prompt_chunks(spec, lengths):
            chunk = {} if images is None else {"images": images[start:stop]}
            out += spec.encode_prompts(self.components, prompts[start:stop], device, **options, **chunk)
        return out

    def encode_references(self, sample) -> dict:
        """``ref_latents_<i>`` of a sample's references, each at its own size (``FamilySpec.encode_references``
        where the family conditions on more than the latents)."""
        spec, device = self.spec, str(self.device)
        if not sample.references:
            return {}
        if spec.encode_references is not None:
            return spec.encode_references(self.components, sample.references, device,
                                          target_shape=tuple(sample.pixels.shape))
        return {f"ref_latents_{i}": self.encode_pixels(ref.unsqueeze(0), None)[0]["latents"]
                for i, ref in enumerate(sample.references)}

    def encode_pixels(self, pixels: torch.Tensor, tile: int | None) -> list[dict]:
        """Pixels ``(B, 3, F, H, W)`` of one shape, in as many VAE calls as the budget needs."""
        spec, device = self.spec, str(self.device)
        _set_tiling(self.components.get("vae"), tile)
        per_call = self.placement.pixels_per_call(spec, *pixels.shape[2:], tile)
        out = []
        for chunk in pixels.split(per_call):
            if spec.encode_pixel_batch is None:
                out += [spec.encode_pixels(self.components, one, device) for one in chunk]
            else:
                out += spec.encode_pixel_batch(self.components, chunk, device)
        return out

    def close(self) -> None:
        self.placement.close()
        self.components.clear()


def _set_tiling(vae, tile: int | None) -> None:
    if vae is None or not hasattr(vae, "use_tiling"):
        return
    if tile:
        enable_vae_tiling(vae, tile)
    elif vae.use_tiling:
        vae.disable_tiling()


def size_bound(cfg: RunConfig, spec: FamilySpec | None = None) -> tuple[int, int, int]:
    """(frames, height, width) bounding the samples the dataset settings allow: the fixed size,
    else a square of ``max_pixels`` (VAE memory grows with height x width, not the aspect); a
    larger reference area of the family's rule (``ReferenceRule.vae_area``) raises it."""
    section = cfg.dataset
    if section.height and section.width:
        frames, height, width = section.num_frames, section.height, section.width
    else:
        side = math.isqrt(section.max_pixels)
        frames, height, width = section.num_frames, side, side
    area = spec.references and (section.reference_pixels or spec.references.vae_area)
    if area and area > height * width:
        side = math.isqrt(area) + spec.references.vae_multiple  # calculate_dimensions rounds up by < one multiple
        return frames, side, side
    return frames, height, width


def load_encoders(cfg: RunConfig, spec: FamilySpec, device: torch.device) -> Encoders:
    """Load what encoding reads (once per process: see ``POOL``) and place it on ``device``."""
    dtype = model_dtype(cfg)
    if spec.load_encoders is not None and not cfg.model.sources:
        components = spec.load_encoders(Path(cfg.model.path), dtype)
    else:  # files as released (model.sources), whole components; or a family without an encoder-only loader
        components = load_components(cfg, spec, spec.encoder_components)
    offload = cfg.preprocess.offload_encoders
    stream = device.type == "cuda" if offload == "auto" else bool(offload)
    placement = place_encoders(components, spec, device, stream, cfg.preprocess.vram_budget_gb,
                               cfg.preprocess.vae_tiling, size_bound(cfg, spec), dtype.itemsize,
                               cfg.preprocess.batch_size)
    log.info("encoders of %s on %s: %s", spec.name, device, placement.report)
    return Encoders(spec, components, placement)


# --- one set of encoders per (model, device), for the life of the process ------------------------

@dataclass(eq=False)
class _Entry:
    encoders: Encoders | None = None
    users: int = 0
    loading: threading.Lock = field(default_factory=threading.Lock)


class EncoderPool:
    """The loaded encoders of this process.  A set stays loaded after its part finishes, so the
    next part (or batch) reuses it; loading a different model on a device first frees that
    device's idle sets.  Thread-safe: parts running in threads share sets."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[tuple, _Entry] = {}
        self.loads = 0  # how many times encoders were loaded (tests, logs)

    @contextlib.contextmanager
    def use(self, key: tuple, device: torch.device, load: Callable[[], Encoders]):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._drop_idle(lambda k: k[-1] == str(device))
                entry = self._entries[key] = _Entry()
            entry.users += 1
        try:
            with entry.loading:
                if entry.encoders is None:
                    entry.encoders = load()
                    with self._lock:
                        self.loads += 1
            yield entry.encoders
        finally:
            with self._lock:
                entry.users -= 1

    def describe(self) -> list[dict]:
        """The loaded sets: family, device and where their weights live (logs, benchmarks)."""
        with self._lock:
            return [{"family": key[0], "device": key[-1], **entry.encoders.placement.report}
                    for key, entry in self._entries.items() if entry.encoders is not None]

    def release(self) -> int:
        """Free every set no part is using (GPU memory, pinned host copies); returns how many."""
        with self._lock:
            return self._drop_idle(lambda key: True)

    def _drop_idle(self, which: Callable[[tuple], bool]) -> int:
        idle = [k for k, e in self._entries.items() if which(k) and e.users == 0]
        for key in idle:
            entry = self._entries.pop(key)
            if entry.encoders is not None:
                entry.encoders.close()
        if idle and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return len(idle)


POOL = EncoderPool()


def release_encoders() -> int:
    """Give back what idle encoders hold (call when this process's parts are done)."""
    return POOL.release()


def _pool_key(cfg: RunConfig, spec: FamilySpec, fingerprint: str, device: torch.device) -> tuple:
    p = cfg.preprocess
    return (spec.name, str(Path(cfg.model.path).resolve()), fingerprint, cfg.model.dtype, p.offload_encoders,
            p.vram_budget_gb, p.vae_tiling, size_bound(cfg, spec), p.batch_size, str(device))


# --- encoding rows into the cache ----------------------------------------------------------------

def row_tile(cfg: RunConfig, spec: FamilySpec, settings: dict) -> int | None:
    """The VAE tile of a row with decode ``settings`` (``SampleDataset.key_settings``), or None."""
    p = cfg.preprocess
    if p.vae_tiling is False or (not p.vram_budget_gb and p.vae_tiling is not True):
        return None
    itemsize = model_dtype(cfg).itemsize
    if settings.get("target_size"):  # a still image of known size
        height, width = settings["target_size"]
        return vae_tile(spec, p.vram_budget_gb, p.vae_tiling, 1, height, width, itemsize=itemsize)
    frames, height, width = size_bound(cfg)  # known only after decoding: decide from the bound
    return vae_tile(spec, p.vram_budget_gb, p.vae_tiling, frames, height, width, exact_size=False,
                    itemsize=itemsize)


def row_key_settings(cfg: RunConfig, spec: FamilySpec, settings: dict) -> dict:
    """Per-row encoding settings for the cache key: the VAE tile, only when the row is tiled
    (so untiled entries keep the keys they always had)."""
    tile = row_tile(cfg, spec, settings)
    return {"vae_tile": tile} if tile else {}


@dataclass
class Encoded:
    """What ``encode_rows`` wrote."""

    rows: int = 0            # rows' conditioning entries (prompt, references) written
    latents: int = 0         # target-latents entries written (the others were in the cache already)
    skipped: list[dict] = field(default_factory=list)             # bad rows (skip_bad_samples)
    empty_prompts: int = 0   # rows' own empty prompts written (Plan.empty_keys)
    truncated: list[tuple[int, int]] = field(default_factory=list)  # (row, tokens kept) of cut prompts


def encode_rows(cfg: RunConfig, plan, store, rows: list[int], part: int | None,
                empty_prompt_key: str | None = None) -> Encoded:
    """Encode ``rows`` of ``plan`` into ``store``: each row's conditioning entry, and its target latents
    unless the cache holds them already (another config over the same image and VAE wrote them).

    ``empty_prompt_key``: also encode the empty prompt under that key (caption dropout's
    replacement embedding; once per cache, an auxiliary entry that is no sample)."""
    device = avoid_broken_kernels(part_device(cfg, part))
    key = _pool_key(cfg, plan.spec, plan.encoders_fingerprint, device)
    with POOL.use(key, device, lambda: load_encoders(cfg, plan.spec, device)) as encoders:
        context = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with context, torch.no_grad():
            if empty_prompt_key is not None:  # first, so it is committed with the part's rows
                _put_empty_prompt(cfg, store, encoders, empty_prompt_key)
            return _encode_batches(cfg, plan, store, rows, encoders)


def _put_empty_prompt(cfg: RunConfig, store, encoders: Encoders, key: str) -> None:
    max_length = cfg.preprocess.max_sequence_length
    with encoders.lock:
        [parts] = encoders.encode_prompts([""], {"max_sequence_length": max_length} if max_length else {})
    entry = {k: _own_host_copy(v) for k, v in parts.items()}
    entry["meta"] = {"prompt": "", "empty_prompt": True}
    store.put(key, entry)


def _encode_batches(cfg: RunConfig, plan, store, rows: list[int], encoders: Encoders) -> Encoded:
    from tqdm.auto import tqdm

    p = cfg.preprocess
    tiles = plan.tiles  # row -> VAE tile, decided when the row was keyed
    max_length = p.max_sequence_length
    options = {"max_sequence_length": max_length} if max_length else {}
    items = decoded(plan.dataset, rows, p.decode_workers, lookahead=max(2 * p.decode_workers, p.batch_size))
    done = Encoded()
    with tqdm(total=len(rows), desc="preprocess", unit="sample") as progress:
        for batch in shape_batches(items, p.batch_size, max_pending=4 * p.batch_size, group=tiles.get):
            samples = [(row, sample) for row, sample in batch if sample is not None]
            done.skipped += [{"row": row, "key": plan.keys[row]} for row, sample in batch if sample is None]
            needs = _batch_needs(plan, store, samples)
            for (row, sample), (latents, entry, empty) in zip(samples, _encode_batch(encoders, samples, needs,
                                                                                       tiles, options)):
                written = done.rows + done.empty_prompts
                if latents is not None:  # first, so a committed row always finds its latents
                    store.put(plan.latent_keys[row], latents)
                    done.latents += 1
                if empty is not None:  # and its own empty prompt
                    store.put(plan.empty_keys[row], empty)
                    done.empty_prompts += 1
                if entry is not None:
                    store.put(plan.keys[row], entry)
                    done.rows += 1
                    if entry["meta"].get("prompt_tokens", 0) > entry["meta"].get("prompt_tokens_kept", 0):
                        done.truncated.append((row, entry["meta"]["prompt_tokens_kept"]))
                # a row may write two entries: commit whenever the count passes a multiple, not only lands on one
                if (done.rows + done.empty_prompts) // p.commit_every > written // p.commit_every:
                    store.commit()
            progress.update(len(batch))
    store.commit()
    return done


@dataclass
class _Needs:
    """What a batch's samples need written: their target latents, conditioning entry, own empty prompt."""

    latents: list[bool]
    entries: list[bool]
    empty: list[bool]


def _batch_needs(plan, store, samples: list) -> _Needs:
    """An entry the cache holds (or this batch writes for an earlier row: targets and empty prompts are
    shared) is not encoded again.  A row is here for its conditioning entry, else for its own empty prompt."""
    needs, in_batch = _Needs([], [], []), set()
    for row, _ in samples:
        latent_key, empty_key = plan.latent_keys[row], plan.empty_keys.get(row)
        needs.latents.append(not store.has(latent_key) and latent_key not in in_batch)
        needs.entries.append(not (store.has(plan.keys[row]) and store.has(latent_key)))
        needs.empty.append(empty_key is not None and not store.has(empty_key) and empty_key not in in_batch)
        in_batch.update(k for k in (latent_key, empty_key) if k is not None)
    return needs


def _encode_batch(encoders: Encoders, samples: list, needs: _Needs, tiles: dict,
                  options: dict) -> list[tuple[dict | None, dict | None, dict | None]]:
    """(target-latents entry, conditioning entry, own empty prompt; each None where not needed) of each sample."""
    if not samples:
        return []
    spec = encoders.spec
    prompts = [str(sample.fields.get("prompt", "")) for _, sample in samples]
    # The vision tower's inputs when the family's text encoder sees the references (None: a text-only call).
    images = ([sample.reference_images for _, sample in samples]
              if spec.references is not None and spec.references.text_area else None)
    entries = [i for i, needed in enumerate(needs.entries) if needed]
    empties = [i for i, needed in enumerate(needs.empty) if needed]
    encode = [sample.pixels for (_, sample), needed in zip(samples, needs.latents) if needed]
    with encoders.lock:
        prompt_parts = dict(zip(entries, encoders.encode_prompts(
            [prompts[i] for i in entries], options, None if images is None else [images[i] for i in entries])
            if entries else []))
        # The empty text with the row's references: what the pipeline encodes for prompt="" and those images.
        empty_parts = dict(zip(empties, encoders.encode_prompts(
            [""] * len(empties), options, [images[i] for i in empties]) if empties else []))
        pixel_parts = iter(encoders.encode_pixels(torch.stack(encode), tiles.get(samples[0][0])) if encode else [])
        reference_parts = {i: encoders.encode_references(samples[i][1]) for i in entries}
    out = []
    for i, ((row, sample), prompt) in enumerate(zip(samples, prompts)):
        size = {"height": sample.height, "width": sample.width, "num_frames": sample.num_frames}
        latents = empty = entry = None
        if needs.latents[i]:
            latents = {k: _own_host_copy(v) for k, v in next(pixel_parts).items()}
            latents["meta"] = {**size, "files": [str(sample.files[0])]}
        if needs.empty[i]:
            empty = {k: _own_host_copy(v) for k, v in empty_parts[i].items()}
            empty["meta"] = {"prompt": "", "empty_prompt": True, "references": len(sample.references)}
        if not needs.entries[i]:
            out.append((latents, None, empty))
            continue
        entry = {k: _own_host_copy(v) for k, v in {**prompt_parts[i], **reference_parts[i]}.items()}
        entry["meta"] = {"row": row, "prompt": prompt, **size, "files": [str(f) for f in sample.files]}
        if sample.references:
            entry["meta"].update(references=len(sample.references),
                                 reference_shapes=[list(entry[f"ref_latents_{i}"].shape)
                                                   for i in range(len(sample.references))])
        if spec.count_prompt_tokens is not None:  # recorded so truncation is reported (issue 9)
            needed_tokens, kept = spec.count_prompt_tokens(encoders.components, prompt, **options)
            entry["meta"].update(prompt_tokens=needed_tokens, prompt_tokens_kept=kept)
        out.append((latents, entry, empty))
    return out


def _own_host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes (a view into a batch would drag the whole batch's
    storage into the cache file)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor
