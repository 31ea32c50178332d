"""Stage-1 benchmark: images/s and GPU peak per family, resident vs offloaded, batch 1 vs N.

    python -m bench.preprocess                        # on a CUDA machine: released encoder layouts
    python -m bench.preprocess --tiny                 # the same code path on the CPU, tiny models
    python -m bench.preprocess --families qwen_image --images 32 --batch 16 --out results.json

Everything runs through ``stages.preprocess.run`` (background decoding, batches, the zarr cache)
on a drawn dataset of JPEGs with prompts of varied lengths.  Released layouts get random weights
(``spec.build_encoders``: Qwen2.5-VL-7B's text decoder at full depth, T5-XXL, umT5-XXL, the
released VAEs), made on the GPU and handed to the engine in place of ``load_encoders``; the
tokenizers are the tiny test ones (the real vocabularies need the hub).  Per family:

* ``resident`` (``offload_encoders = false``) and ``offloaded`` (streamed, within the family's
  ``vram_budget_gb``): images/s at batch 1 and batch N after a warm-up run that loads the
  encoders and writes the cache's one-off empty prompt; GPU peak per run (``max_memory_allocated``
  in GiB, the unit of ``vram_budget_gb``); how far batch N's entries are from batch 1's (the
  batching tolerance);
* ``memory``: the issue's targets -- Qwen-Image at 1328x1328 and FLUX.1-dev at 1024x1024 within
  8 GiB, Wan2.1 with 81 frames at 480x832 within 12 GiB, FLUX.2-dev (``--families flux2:dev``: its 24 B
  Mistral-Small-3.2, 512-token prompts) and klein 9B at 1024x1024 within 8 GiB (offloaded, one part, after
  a warm-up);
* ``vae_bytes_per_pixel``: one VAE encode's measured peak over its pixels, beside the family's
  estimate that the budget logic uses;
* ``gpus``: 1 vs all GPUs (``preprocess.devices = "all"``, one part per GPU) when there are several.

Prints one JSON document (also written to ``--out``); partial results are written after each step.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import random
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cache_store import open_cache  # noqa: E402
from diffsynth_core.models import get_family  # noqa: E402
from stages import encoding, preprocess  # noqa: E402
from stages.config import build_config  # noqa: E402

GB = 1e9
# family -> (image side for throughput, memory-target sample (frames, height, width), budget GB)
# (a family's variant as ``family:variant``: FLUX.2-dev's 24 B Mistral, klein 9B's Qwen3-8B)
TARGETS = {"qwen_image": (1024, (1, 1328, 1328), 8.0), "flux": (1024, (1, 1024, 1024), 8.0),
           "wan": (None, (81, 480, 832), 12.0), "qwen_image21": (1024, (1, 1024, 1024), 8.0)}
TINY = {"qwen_image": (64, (1, 96, 96), 0.0), "flux": (64, (1, 96, 96), 0.0), "wan": (None, (5, 64, 64), 0.0),
        "qwen_image21": (64, (1, 96, 96), 0.0)}
# Variants (``--families family:variant``): Edit-2509 with two references at 1024^2 (throughput) and a 1328^2
# target with three references within 8 GiB (memory; the vision tower sees each reference, the VAE encodes
# target and references); Wan2.2 TI2V-5B's umT5 and 16x VAE at 121 frames of 704x1280 within 12 GiB; FLUX.2-dev's
# 24 B Mistral and klein 9B's Qwen3 within 8 GiB.  variant -> (throughput side, memory sample, budget GB,
# references (throughput, memory), released encoders (None: the variant's first))
VARIANTS = {"qwen_image:edit-2509": (1024, (1, 1328, 1328), 8.0, (2, 3), "Qwen-Image"),
            "wan:ti2v-5b": (None, (121, 704, 1280), 12.0, (0, 0), "Wan2.2"),
            "flux2:dev": (1024, (1, 1024, 1024), 8.0, (0, 0), None),
            "flux2:klein-base-9b": (1024, (1, 1024, 1024), 8.0, (0, 0), None)}
TINY_VARIANTS = {"qwen_image:edit-2509": (64, (1, 96, 96), 0.0, (2, 3), None),
                 "wan:ti2v-5b": (None, (5, 64, 64), 0.0, (0, 0), None),
                 "flux2:dev": (64, (1, 96, 96), 0.0, (0, 0), None),
                 "flux2:klein-base-9b": (64, (1, 96, 96), 0.0, (0, 0), None)}
WORDS = ("a photo of red blue green small large old young cat dog house tree river mountain city street "
         "at night in the morning under soft light with a wide lens detailed painting watercolor").split()


# --- inputs -------------------------------------------------------------------------------------

def write_dataset(folder: Path, count: int, side: int, seed: int = 0, references: int = 0) -> Path:
    """``count`` smooth random JPEGs of ``side`` x ``side`` with prompts of 5-60 words; with ``references``,
    each row names that many of the other images as its ``edit_image`` list (DiffSynth's edit layout)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        low = (torch.rand(3, 16, 16, generator=gen) * 255).to(torch.uint8)
        image = Image.fromarray(low.permute(1, 2, 0).numpy()).resize((side, side), Image.BICUBIC)
        image.save(folder / f"{i:04d}.jpg", quality=90)
        rows.append({"image": f"{i:04d}.jpg", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))})
    for i, row in enumerate(rows):
        if references:
            row["edit_image"] = json.dumps([f"{(i + k) % count:04d}.jpg" for k in range(1, references + 1)])
    with open(folder / "metadata.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return folder / "metadata.csv"


@contextlib.contextmanager
def released_encoders(spec, variant: str | None, resident: bool):
    """Stage 1 loads ``spec.build_encoders(variant)`` (random weights) instead of the folder's files.

    Stage 1 resolves its own spec from the config (a variant's spec is a fresh copy each time), so the
    loader is swapped where stage 1 loads encoders, for every spec of this family."""
    if variant is None:
        yield
        return
    real = encoding.load_encoders

    def build(path, dtype):
        comps = spec.build_encoders(variant, dtype, "cuda")  # random weights are made fastest on the GPU
        if not resident:  # offloaded encoders start in host memory, like loaded ones
            comps = {k: v.to("cpu") if isinstance(v, torch.nn.Module) else v for k, v in comps.items()}
            torch.cuda.empty_cache()
        return comps

    def load(cfg, resolved, device):
        if resolved.name == spec.name:
            resolved = dataclasses.replace(resolved, load_encoders=build)
        return real(cfg, resolved, device)

    encoding.load_encoders = load
    try:
        yield
    finally:
        encoding.load_encoders = real


# --- measuring ----------------------------------------------------------------------------------

def _cuda() -> bool:
    return torch.cuda.is_available()


def _reset_peak() -> None:
    if _cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    """Peak of the torch allocator since the last reset, in GiB (the unit of vram_budget_gb)."""
    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if _cuda() else None


def _nvml_used_gib() -> float | None:
    """This process's GPU memory as the driver sees it (context and allocator cache included)."""
    try:
        import os

        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return round(proc.usedGpuMemory / 2**30, 3)
    except Exception:  # noqa: BLE001 - telemetry only
        return None
    return None


def run_once(cfg) -> dict:
    """One part holding every row (``part=0`` of 1: no finalize, so the encoders stay loaded)."""
    _reset_peak()
    start = time.perf_counter()
    summary = preprocess.run(cfg, 0)
    seconds = time.perf_counter() - start
    return {"encoded": summary.encoded, "seconds": round(seconds, 3),
            "images_per_s": round(summary.encoded / seconds, 3), "gpu_peak_gib": _peak_gib(),
            "nvml_used_gib": _nvml_used_gib()}


def batching_tolerance(url_a: str, url_b: str) -> dict:
    """Largest |a - b| per tensor name between two caches of the same rows, and relative to max |a|."""
    a, b = open_cache(url_a, mode="r"), open_cache(url_b, mode="r")
    worst: dict[str, list[float]] = {}
    for key in a.keys():
        ea, eb = a.get(key), b.get(key)
        for name, ta in ea.items():
            if isinstance(ta, torch.Tensor):
                diff = (ta.float() - eb[name].float()).abs().max().item()
                scale = ta.float().abs().max().item() or 1.0
                old = worst.setdefault(name, [0.0, 0.0])
                worst[name] = [max(old[0], diff), max(old[1], diff / scale)]
    return {name: {"max_abs": round(v[0], 6), "max_rel": round(v[1], 6)} for name, v in worst.items()}


# --- one family ---------------------------------------------------------------------------------

class Bench:
    def __init__(self, args, name: str, root: Path, report: dict):
        """``name``: a family, or ``family:variant`` (``VARIANTS``)."""
        self.args, self.root, self.report = args, root, report
        self.family, _, self.spec_variant = name.partition(":")
        self.spec = get_family(self.family, self.spec_variant or None)
        if self.spec_variant:
            self.side, self.memory_sample, self.budget, (self.references, self.memory_references), layout = (
                TINY_VARIANTS if args.tiny else VARIANTS)[name]
        else:
            self.side, self.memory_sample, self.budget = (TINY if args.tiny else TARGETS)[name]
            self.references = self.memory_references = 0
            layout = self.spec.encoder_variants[0]
        self.variant = None if args.tiny else layout or self.spec.encoder_variants[0]
        self.model = self.spec.save_tiny_model(root / "model", 0)  # configs for identity; weights replaced
        self.out = report.setdefault(name, {"variant": self.variant or "tiny", "references": self.references,
                                            "memory_references": self.memory_references})

    def config(self, name: str, metadata: Path, side: int, dataset: dict | None = None, **preprocess_keys):
        keys = {"decode_workers": 4, "commit_every": 64, **preprocess_keys}
        if self.references or self.memory_references:  # references at the target's area, as the edit pipelines
            dataset = {"data_file_keys": ["image", "edit_image"], "reference_pixels": side * side, **(dataset or {})}
        return build_config({
            "dataset": {"metadata_path": str(metadata), "max_pixels": side * side, **(dataset or {})},
            "model": {"family": self.family, "path": str(self.model), "dtype": "bfloat16",
                      **({"variant": self.spec_variant} if self.spec_variant else {})},
            "cache": {"url": str(self.root / f"{name}.zarr")}, "output": {"path": str(self.root / "out")},
            "preprocess": {"device": "cuda" if _cuda() else "cpu", **keys}})

    def save(self) -> None:
        self.args.out and Path(self.args.out).write_text(json.dumps(self.report, indent=2))

    def throughput(self) -> None:
        if self.side is None:
            return
        data = write_dataset(self.root / "images", self.args.images, self.side, references=self.references)
        warm = write_dataset(self.root / "warm", 3, self.side, seed=1, references=self.references)
        for mode in ("resident", "offloaded"):
            resident = mode == "resident"
            keys = {"offload_encoders": not resident, "vram_budget_gb": 0.0 if resident else self.budget}
            result = self.out.setdefault(mode, {})
            with released_encoders(self.spec, self.variant, resident):
                for batch in (1, self.args.batch):
                    # The batch size is part of the encoders' placement (how a budget splits between resident
                    # text blocks and prompts a call): each gets its own set, loaded before it is timed.  The
                    # warm-up writes the cache the timed run goes on with, so the cache's one-off entry (the
                    # empty prompt: a whole streamed pass for one prompt) is not charged to the timed rows.
                    start = time.perf_counter()
                    preprocess.run(self.config(f"{mode}-b{batch}", warm, self.side, batch_size=batch, **keys), 0)
                    loaded = {"load_and_warmup_s": round(time.perf_counter() - start, 2),
                              "placement": encoding.POOL.describe()}
                    cfg = self.config(f"{mode}-b{batch}", data, self.side, batch_size=batch, **keys)
                    result[f"batch_{batch}"] = run = {**run_once(cfg), **loaded}
                    if not resident and run["gpu_peak_gib"] is not None:
                        run["within_budget"] = run["gpu_peak_gib"] <= self.budget
                    self.save()
                    encoding.release_encoders()
                result["batch_tolerance"] = batching_tolerance(
                    str(self.root / f"{mode}-b1.zarr"), str(self.root / f"{mode}-b{self.args.batch}.zarr"))
            encoding.release_encoders()
        b = f"batch_{self.args.batch}"
        self.out["offloaded_vs_resident"] = {
            key: round(self.out["offloaded"][key]["images_per_s"] / self.out["resident"][key]["images_per_s"], 3)
            for key in ("batch_1", b)}

    def memory(self) -> None:
        frames, height, width = self.memory_sample
        keys = {"offload_encoders": True, "vram_budget_gb": self.budget, "batch_size": 4}
        with released_encoders(self.spec, self.variant, resident=False):
            if frames == 1:
                refs = self.memory_references
                warm = write_dataset(self.root / "memory-warm", 4, height, seed=3, references=refs)
                preprocess.run(self.config("memory-warm", warm, height, **keys), 0)  # loads the encoders
                data = write_dataset(self.root / "memory", 4, height, seed=2, references=refs)
                result = run_once(self.config("memory", data, height, **keys))
            else:  # videos: straight through the engine (no video writer on the GPU machine)
                result = self.video_memory(frames, height, width, keys)
            result["placement"] = encoding.POOL.describe()
        encoding.release_encoders()
        result.update(sample=[frames, height, width], budget_gb=self.budget)
        if result["gpu_peak_gib"] is not None:
            result["within_budget"] = result["gpu_peak_gib"] <= self.budget
        self.out["memory"] = result
        self.save()

    def video_memory(self, frames: int, height: int, width: int, keys: dict) -> dict:
        cfg = self.config("video", self.root / "none.csv", 16, dict(num_frames=frames, height=height, width=width),
                          **keys)
        device = encoding.part_device(cfg, None)
        pixels = torch.rand(1, 3, frames, height, width) * 2 - 1
        load = lambda: encoding.load_encoders(cfg, self.spec, device)  # noqa: E731
        with encoding.POOL.use(("bench-video", str(device)), device, load) as enc:
            _reset_peak()
            start = time.perf_counter()
            with torch.no_grad():
                enc.encode_prompts([" ".join(WORDS[:40])], {})
                enc.encode_pixels(pixels, None)
            if _cuda():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        return {"encoded": 1, "seconds": round(seconds, 3), "gpu_peak_gib": _peak_gib(), "nvml_used_gib": _nvml_used_gib()}

    def vae_bytes_per_pixel(self) -> None:
        """One untiled VAE encode on the device: measured activation peak vs the family's estimate."""
        if not _cuda():
            return
        frames, height, width = self.memory_sample
        vae = self.spec.build_encoders(self.variant, torch.bfloat16, "cuda")["vae"]
        pixels = torch.rand(1, 3, frames, height, width, device="cuda", dtype=torch.bfloat16) * 2 - 1
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            self.spec.encode_pixel_batch({"vae": vae}, pixels, "cuda")
        measured = torch.cuda.max_memory_allocated() - base
        del vae, pixels
        torch.cuda.empty_cache()
        window = min(frames, 5) if frames > 1 else 1
        self.out["vae_bytes_per_pixel"] = {
            "sample": [frames, height, width], "measured_peak_gb": round(measured / GB, 3),
            "measured": round(measured / (window * height * width)),
            "estimate": round(self.spec.vae_encode_bytes(frames, height, width) / (window * height * width))}
        self.save()

    def gpus(self) -> None:
        count = torch.cuda.device_count() if _cuda() else 0
        if count < 2 or self.side is None:
            self.out["gpus"] = {"visible": count, "note": "one GPU here: the 1 vs 2/4-GPU scaling was not run"}
            return
        data = self.root / "images" / "metadata.csv"
        if not data.is_file():  # `--steps gpus` alone: the throughput step did not write them
            write_dataset(self.root / "images", self.args.images, self.side)
            write_dataset(self.root / "warm", 2, self.side, seed=1)
        keys = {"offload_encoders": True, "vram_budget_gb": self.budget, "batch_size": self.args.batch}
        result = {}
        with released_encoders(self.spec, self.variant, resident=False):
            for devices, parts in ((["cuda:0"], 1), ("all", count)):
                cfg = self.config(f"gpus-{parts}", data, self.side, devices=devices, parts=parts, **keys)
                for part in range(parts):  # warm-up: load every device's encoders
                    preprocess.run(self.config(f"gpus-warm-{parts}-{part}", self.root / "warm" / "metadata.csv",
                                               self.side, devices=devices, parts=parts, **keys), part)
                start = time.perf_counter()
                with ThreadPoolExecutor(parts) as pool:  # how the preprocess flow runs parts
                    encoded = sum(s.encoded for s in pool.map(lambda k: preprocess.run(cfg, k), range(parts)))
                result[f"{parts}_gpus_images_per_s"] = round(encoded / (time.perf_counter() - start), 3)
            encoding.release_encoders()
        result["scaling_vs_linear"] = round(result[f"{count}_gpus_images_per_s"]
                                            / (count * result["1_gpus_images_per_s"]), 3)
        self.out["gpus"] = result
        self.save()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="qwen_image,flux,wan")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU (checks the code path)")
    parser.add_argument("--images", type=int, default=32, help="images per throughput run")
    parser.add_argument("--batch", type=int, default=16, help="the batch size N compared with 1")
    parser.add_argument("--steps", default="throughput,memory,vae,gpus")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if _cuda():
        from diffsynth_core.training.device import avoid_broken_kernels

        avoid_broken_kernels("cuda")
    report: dict = {"device": torch.cuda.get_device_name() if _cuda() else "cpu", "torch": torch.__version__}
    steps = args.steps.split(",")
    for family in args.families.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"bench-preprocess-{family.replace(':', '-')}-"))
        try:
            bench = Bench(args, family, root, report)
            for step, run in (("throughput", bench.throughput), ("memory", bench.memory),
                              ("vae", bench.vae_bytes_per_pixel), ("gpus", bench.gpus)):
                if step in steps:
                    t = time.perf_counter()
                    try:
                        run()
                    except Exception as err:  # noqa: BLE001 - one failed step must not lose the others
                        bench.out.setdefault("errors", {})[step] = f"{type(err).__name__}: {err}"
                        encoding.release_encoders()
                    bench.out.setdefault("step_seconds", {})[step] = round(time.perf_counter() - t, 1)
                    bench.save()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    report["host_peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 2)
    return emit(report, args.out)


def emit(report: dict, out: str | None) -> dict:
    """Print the JSON document (and write it to ``out``)."""
    print(json.dumps(report, indent=2))
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
