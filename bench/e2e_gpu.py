"""End to end at real size: build a random Qwen-Image model folder, then ``splitflow run`` it on CUDA.

    python -m bench.e2e_gpu --workdir /tmp/e2e [--dit-layers 60] [--te-layers 2] [--images 8] [--steps 6]
                            [--set offload.vram_budget_gb=22.35 ...] [--out FILE]

The folder is the diffusers layout ``splitflow`` loads: the DiT in Qwen-Image's released layout
(full depth by default: 60 blocks, 20.4 B parameters, random bf16 weights made on the GPU and
written shard by shard), the Qwen2.5-VL text encoder at the 7 B model's widths but only
``--te-layers`` deep (its embedding table and output head at full size), the released VAE layout,
and an offline tokenizer.  The dataset is ``--images`` random photos (noise) at ``--pixels``².
``splitflow run`` (preprocess -> cache -> train with the DiT streamed by the offload engine) runs
as a child process while this one samples host RAM (the child's resident set, and the whole
process tree with Prefect's server) and GPU memory (NVML) every 0.2 s.  Prints one JSON document:
per-stage wall time, images/s of each stage, s/step, GPU peak (torch, from the engine's report,
and NVML), host RAM peak against the DiT's bytes, bytes streamed per step (planned and measured).
``--quick`` makes every component tiny-but-real (runs on a CPU in a minute or two).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 1e9


# --- the model folder --------------------------------------------------------------------------------
def text_encoder(tokenizer, layers: int, quick: bool):
    """Qwen2.5-VL at the 7 B model's text widths (vocabulary 152064, hidden 3584), ``layers`` deep."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    v, eos = 152064, tokenizer.eos_token_id
    width = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1) if quick else \
        dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)
    config = Qwen2_5_VLConfig(
        text_config=dict(**width, num_hidden_layers=layers, vocab_size=v, bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=eos, rope_scaling={"mrope_section": [16, 24, 24] if not quick else [2, 3, 3],
                                                         "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=width["hidden_size"]),
        vocab_size=v, vision_start_token_id=v - 4, vision_end_token_id=v - 3, image_token_id=v - 2,
        video_token_id=v - 1, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    return model


def dit_layout(dit_layers: int, quick: bool) -> dict:
    from diffsynth_core.models import qwen_image

    layout = dict(qwen_image.TRANSFORMER_CONFIGS["tiny" if quick else "Qwen-Image"])
    return layout if quick else {**layout, "num_layers": dit_layers}


def dit_bytes(dit_layers: int, quick: bool) -> int:
    """Bytes of the DiT's weights (counted on the meta device: nothing is allocated)."""
    from diffsynth_core.models import qwen_image
    from diffsynth_core.models.random_models import build_random_transformer

    meta = build_random_transformer(qwen_image.TRANSFORMER_CLASS, {"e2e": dit_layout(dit_layers, quick)}, "e2e",
                                    torch.bfloat16, "meta")
    return sum(p.numel() * p.element_size() for p in meta.parameters())


def reuse(folder: Path, settings: dict) -> bool:
    """Whether ``folder`` already holds what ``settings`` would build (its ``bench-settings.json``
    says so); a folder built with other settings stops the run: its figures would be wrong."""
    path = folder / "bench-settings.json"
    if path.is_file() and json.loads(path.read_text()) == settings:
        return True
    if folder.exists() and any(folder.iterdir()):
        why = "was built with other settings than" if path.is_file() else "holds a build without settings, not"
        raise SystemExit(f"{folder} {why} {settings}; remove it or pick another --workdir")
    return False


def stamp(folder: Path, settings: dict) -> None:
    (folder / "bench-settings.json").write_text(json.dumps(settings))


def write_model(folder: Path, dit_layers: int, te_layers: int, quick: bool) -> None:
    """The model folder (kept when it was built with the same settings); run in a child process,
    so the GPU memory it used is gone before ``splitflow run`` starts."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    from diffsynth_core.models import qwen_image, tiny_tokenizers
    from diffsynth_core.models.random_models import build_random_transformer

    settings = {"dit_layers": dit_layers, "te_layers": te_layers, "quick": quick}
    if reuse(folder, settings):
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dit = build_random_transformer(qwen_image.TRANSFORMER_CLASS, {"e2e": dit_layout(dit_layers, quick)}, "e2e",
                                   torch.bfloat16, device)
    tokenizer = tiny_tokenizers.qwen2_tokenizer()
    vae = AutoencoderKLQwenImage(**(dict(base_dim=8, num_res_blocks=1) if quick else {})).to(torch.bfloat16)
    pipe = qwen_image._pipeline_cls()(
        scheduler=FlowMatchEulerDiscreteScheduler(**qwen_image.SCHEDULER_CONFIG), vae=vae,
        text_encoder=text_encoder(tokenizer, te_layers, quick), tokenizer=tokenizer, transformer=dit)
    pipe.save_pretrained(folder, max_shard_size="5GB")  # written shard by shard, from the GPU
    stamp(folder, settings)


def write_dataset(folder: Path, count: int, pixels: int) -> Path:
    from PIL import Image

    meta = folder / "metadata.csv"
    settings = {"images": count, "pixels": pixels}
    if reuse(folder, settings):
        return meta
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        noise = torch.randint(0, 256, (pixels, pixels, 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(noise).save(folder / f"{i:03d}.png")
        rows.append({"image": f"{i:03d}.png", "prompt": f"a photo of a cat and a dog, number {i}"})
    with meta.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    stamp(folder, settings)
    return meta


def write_config(workdir: Path, meta: Path, steps: int, pixels: int, quick: bool) -> Path:
    import tomli_w

    cfg = {"dataset": {"base_path": str(meta.parent), "metadata_path": str(meta), "max_pixels": pixels * pixels},
           "model": {"family": "qwen_image", "path": str(workdir / "model"), "dtype": "bfloat16"},
           "cache": {"url": str(workdir / "cache.zarr")},
           "preprocess": {"parts": 1},
           "train": {"max_steps": steps, "save_steps": 0, "lora_rank": 32, "gradient_checkpointing": True},
           "offload": {"enable_model_cpu_offload": True},
           "output": {"path": str(workdir / "out")}}
    if quick:
        cfg["preprocess"]["device"] = cfg["train"]["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    (workdir / "out").mkdir(exist_ok=True)  # Prefect keeps its home (and temporary server's database) there
    path = workdir / "config.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


# --- running and sampling ----------------------------------------------------------------------------
class Sampler:
    """Peak resident set of a process and of its whole tree every 0.2 s, and the process's peak
    anonymous memory (``RssAnon + RssShmem``: what the kernel cannot drop under pressure, unlike
    the pages of the mapped safetensors files that the resident set also counts); NVML GPU memory
    (bench.offload)."""

    def __init__(self, pid: int):
        import psutil

        from bench.offload import PeakSampler

        self.proc, self.psutil = psutil.Process(pid), psutil
        self.rss = self.tree = self.anon = self.file = 0
        self.gpu = PeakSampler()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2):
            try:
                fields = rss_fields(self.proc.pid)
                rss = fields.get("VmRSS", 0)
                tree = rss + sum(c.memory_info().rss for c in self.proc.children(recursive=True))
            except (self.psutil.Error, OSError):
                continue
            self.rss, self.tree = max(self.rss, rss), max(self.tree, tree)
            self.anon = max(self.anon, fields.get("RssAnon", 0) + fields.get("RssShmem", 0))
            self.file = max(self.file, fields.get("RssFile", 0))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"host_peak_gb": self.rss / GB, "host_tree_peak_gb": self.tree / GB,
                "host_anon_peak_gb": self.anon / GB, "host_file_mapped_peak_gb": self.file / GB,
                "gpu_peak_nvml_gb": self.gpu.stop()}


def rss_fields(pid: int) -> dict[str, int]:
    """VmRSS split as /proc/PID/status splits it: RssAnon, RssFile, RssShmem (bytes)."""
    out = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                name, value = line.split(":", 1)
                out[name] = int(value.split()[0]) * 1024
    return out


def run_splitflow(config: Path, extra: list[str]) -> tuple[dict, dict, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid)
    output = proc.communicate()[0]
    wall = time.perf_counter() - started
    peaks = sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"splitflow run failed ({proc.returncode}):\n{output[-4000:]}")
    start = output.index("{\n")  # the CLI prints the flow's result as indented JSON last
    return json.loads(output[start:output.rindex("}") + 1]), peaks, wall


def summarise(result: dict, peaks: dict, wall: float, dit_bytes: int, images: int) -> dict:
    from diffsynth_core.training.metrics import read_metrics

    train = result["train"]
    rows = read_metrics(Path(train["output"]) / "metrics.csv")
    step_times = [float(r["step_time_s"]) for r in rows]
    report = json.loads((Path(train["output"]) / "offload.json").read_text())
    pre_s = wall - train["seconds"]
    return {
        "wall_s": wall, "stages_s": {"preprocess_incl_start": pre_s, "train": train["seconds"]},
        "images_per_s": {"preprocess": images / pre_s, "train": statistics.median(float(r["samples_per_s"]) for r in rows[1:])},
        "s_per_step": statistics.median(step_times[1:]), "s_per_step_all": step_times,
        "gpu_peak_torch_gb": (report.get("gpu_peak_bytes") or 0) / GB, **peaks,
        "dit_gb": dit_bytes / GB, "host_peak_over_dit": peaks["host_peak_gb"] / (dit_bytes / GB),
        "host_anon_peak_over_dit": peaks["host_anon_peak_gb"] / (dit_bytes / GB),
        "h2d_gb_per_step": report["last_step_h2d_bytes"] / GB,
        "planned_h2d_gb_per_step": (report.get("planned_h2d_bytes_per_step") or 0) / GB,
        "resident_units": report["budget_units"], "units": report["units"], "exports": train["exports"],
        "final_loss": train["final_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/splitflow-e2e")
    ap.add_argument("--dit-layers", type=int, default=60)
    ap.add_argument("--te-layers", type=int, default=2)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--pixels", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="extra `splitflow run --set` overrides")
    ap.add_argument("--out", default=None)
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if a.build_only:
        write_model(workdir / "model", a.dit_layers, a.te_layers, a.quick)
        return
    t0 = time.perf_counter()
    build = [sys.executable, "-m", "bench.e2e_gpu", "--build-only", "--workdir", str(workdir),
             "--dit-layers", str(a.dit_layers), "--te-layers", str(a.te_layers)] + (["--quick"] if a.quick else [])
    subprocess.run(build, cwd=ROOT, check=True)
    size = dit_bytes(a.dit_layers, a.quick)
    meta = write_dataset(workdir / "dataset", a.images, a.pixels)
    build_s = time.perf_counter() - t0
    config = write_config(workdir, meta, a.steps, a.pixels, a.quick)
    result, peaks, wall = run_splitflow(config, [arg for s in a.set for arg in ("--set", s)])
    out = {"build_s": build_s, **summarise(result, peaks, wall, size, a.images),
           "settings": {"dit_layers": a.dit_layers, "te_layers": a.te_layers, "images": a.images, "pixels": a.pixels,
                        "steps": a.steps, "set": a.set}}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
