"""Bad inputs through the CLI (``preprocess --part K`` and ``train --in-process``, the verbs that run
without Prefect): each gives one line naming the row, file, key or path, the documented exit code
(2 input, 3 environment) and no traceback; a diverging run writes nothing non-finite; a full disk or
a read-only folder (real tmpfs mounts in a private mount namespace) keeps what was written."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from stages.config import load_config
from stages.demo import write_demo_model

from .one_line import assert_one_line as _assert_one_line
from .one_line import cli as _cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cached(preprocessed_demo) -> Path:
    """The shared preprocessed demo (config.toml, cache.zarr); tests copy what they damage."""
    return preprocessed_demo


@pytest.fixture(autouse=True)
def _no_prefect_console_handlers():
    """Prefect, imported by the flows tests of this pytest process, leaves console handlers on the
    root logger bound to streams pytest has closed since; a CLI process running these verbs never
    imports Prefect, so they are set aside here (and put back)."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [h for h in saved if not type(h).__module__.startswith("prefect")]
    yield
    root.handlers = saved


def _rows(folder: Path, text: str) -> Path:
    (folder / "metadata.csv").write_text(text)
    return folder


@pytest.fixture
def data(cached, tmp_path):
    """A private dataset folder with one good image; returns (folder, --set args for preprocess)."""
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(next((cached / "dataset").glob("*.png")), folder / "ok.png")
    args = ["--set", f"dataset.base_path={folder}", "--set", f"dataset.metadata_path={folder / 'metadata.csv'}",
            "--set", f"cache.url={tmp_path / 'cache.zarr'}", "--set", f"output.path={tmp_path / 'out'}"]
    return folder, args


def _gif(path: Path, frames: int) -> None:
    images = [Image.new("RGB", (32, 32), (40 * i, 0, 0)) for i in range(frames)]
    images[0].save(path, save_all=True, append_images=images[1:])


def _animated(path: Path) -> None:
    frames = [Image.new("RGB", (32, 32), (80 * i, 0, 0)) for i in range(3)]
    frames[0].save(path, save_all=True, append_images=frames[1:])


# Each case: metadata text, files to make, extra --set overrides, fragments of the one line.
DATA_CASES = {
    "unquoted comma": ("image,prompt\nok.png,a cat, sitting on a mat\n", None, [],
                       ["data row 1 (index 0)", "line 2 has 3 cells", "unquoted comma"]),
    "symlink to /dev/zero": ("image,prompt\nz.png,x\n", lambda d: os.symlink("/dev/zero", d / "z.png"), [],
                             ["z.png", "is a character device (symlink to /dev/zero)"]),
    "folder named x.png": ("image,prompt\nx.png,x\n", lambda d: (d / "x.png").mkdir(), [],
                           ["x.png", "is a folder, not a media file"]),
    "FIFO": ("image,prompt\nf.png,x\n", lambda d: os.mkfifo(d / "f.png"), [], ["f.png", "named pipe (FIFO)"]),
    "../ path": ("image,prompt\n../outside.png,x\n", lambda d: shutil.copy(d / "ok.png", d.parent / "outside.png"),
                 [], ["outside.png", "outside the dataset folder", "dataset.allow_external_paths"]),
    "GIF for an image family": ("video,prompt\nclip.gif,x\n", lambda d: _gif(d / "clip.gif", 5),
                                ["dataset.num_frames=5"], ["clip.gif", "trains on still images only"]),
    # a quote left open would read every later row into one prompt
    "unclosed quote": ('image,prompt\nok.png,"a cat\nok.png,a dog\nok.png,a bird\n', None, [],
                       ["a quote opened on line 2 is not closed", "close the quote"]),
    "quote closed rows later": ('image,prompt\nok.png,"a cat\nok.png,a dog\nok.png,"a bird"\n', None, [],
                                ["a quote opened on line 2 is not closed"]),
    "quoted cell swallowing a row": ('image,prompt\nok.png,"a cat\nok.png,a dog"\n', None, [],
                                     ["a quoted cell opened on line 2 runs over", "'ok.png,a dog'"]),
    "animated WebP for an image family": ("image,prompt\nanim.webp,x\n", lambda d: _animated(d / "anim.webp"), [],
                                          ["anim.webp", "is animated (3 frames)"]),
    "APNG for an image family": ("image,prompt\nanim.png,x\n", lambda d: _animated(d / "anim.png"), [],
                                 ["anim.png", "is animated (3 frames)"]),
    "whitespace-only prompt": ('image,prompt\nok.png,"   "\n', None, [],
                               ["data row 1 (index 0)", "column 'prompt' must hold text"]),
    "unknown model.family": ("image,prompt\nok.png,x\n", None, ["model.family=sdxl"], ["model.family = 'sdxl'"]),
    "family not matching the model folder": ("image,prompt\nok.png,x\n", None, ["model.family=wan"],
                                             ["holds a QwenImagePipeline model", "model.family = 'qwen_image'"]),
    "preprocess.device=tpu9": ("image,prompt\nok.png,x\n", None, ["preprocess.device='tpu9'"],
                               ["preprocess.device: 'tpu9' is not a device"]),
    "background not a colour": ("image,prompt\nok.png,x\n", None, ["dataset.background='transparent'"],
                                ["dataset.background: 'transparent' is not a colour"]),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_bad_data_and_model_settings_give_one_line_exit_2(cached, data, capsys, case):
    text, make, overrides, fragments = DATA_CASES[case]
    folder, args = data
    _rows(folder, text)
    if make is not None:
        make(folder)
    sets = [arg for value in overrides for arg in ("--set", value)]
    code, err = _cli(capsys, "preprocess", cached / "config.toml", "--part", 0, *args, *sets)
    _assert_one_line(code, err, 2, *fragments)


def test_bad_rows_are_skipped_with_skip_bad_samples(cached, data, capsys, caplog):
    folder, args = data
    (folder / "x.png").mkdir()
    os.symlink("/dev/zero", folder / "z.png")
    _gif(folder / "clip.gif", 3)
    _rows(folder, "image,video,prompt\nx.png,,a\nz.png,,b\n,clip.gif,c\nok.png,,d\n")
    code, err = _cli(capsys, "preprocess", cached / "config.toml", "--part", 0, *args,
                     "--set", "dataset.skip_bad_samples=true")
    assert code == 0 and "Traceback" not in err and "1 encoded, 0 already cached, 3 bad rows skipped" in capsys.out
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping bad sample")]
    assert [("x.png" in m, "z.png" in m, "clip.gif" in m) for m in skipped] == [
        (True, False, False), (False, True, False), (False, False, True)]


def test_a_short_video_is_an_error_naming_row_and_file(cached, data, capsys, tmp_path_factory):
    wan = write_demo_model(tmp_path_factory.mktemp("wan") / "model", "wan")
    folder, args = data
    _gif(folder / "clip.gif", 3)
    _rows(folder, "video,prompt\nclip.gif,x\n")
    code, err = _cli(capsys, "preprocess", cached / "config.toml", "--part", 0, *args, "--set", "model.family=wan",
                     "--set", f"model.path={wan}", "--set", "dataset.num_frames=9")
    _assert_one_line(code, err, 2, "data row 1 (index 0)", "clip.gif", "has 3 frames, fewer than dataset.num_frames = 9")


def test_truncated_prompts_are_counted_and_reported(cached, data, capsys, caplog):
    folder, args = data
    _rows(folder, f"image,prompt\nok.png,short\nok.png,{'word ' * 2000}\n")
    code, err = _cli(capsys, "preprocess", cached / "config.toml", "--part", 0, *args)
    assert code == 0 and "2 encoded, 0 already cached, 1 prompts truncated" in capsys.out
    assert any("1 prompt(s) are longer than the text encoder keeps (1024 tokens) and were truncated: data rows 2;"
               in r.getMessage() for r in caplog.records)
    # Qwen-Image keeps at most 1024 tokens whatever the config says: the line does not send users to a key
    # that cannot help
    assert any("this is the text encoder's own limit, which preprocess.max_sequence_length cannot raise"
               in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("override, fragments", [
    ("model.family=flux", ["holds a QwenImagePipeline model", "model.family = 'flux'", "model.family = 'qwen_image'"]),
    ("model.path=''", ["model.path is empty"]),
], ids=["another family's folder", "empty model.path"])
def test_model_settings_at_train_time_name_the_model_not_the_cache(cached, capsys, tmp_path, override, fragments):
    code, err = _cli(capsys, "train", cached / "config.toml", "--in-process", "--set", override,
                     "--set", f"output.path={tmp_path / 'out'}")
    _assert_one_line(code, err, 2, *fragments)


CONFIG_CASES = {
    "train.learning_rate=inf": "train.learning_rate: Input should be a finite number",
    "train.learning_rate=nan": "train.learning_rate: Input should be a finite number",
    "train.lora_alpha=-4": "train.lora_alpha: Input should be greater than 0",
    "train.lora_rank=-1": "train.lora_rank: Input should be greater than or equal to 0",
    "train.max_steps=0": "train.max_steps: Input should be greater than or equal to 1",
    "train.shift=inf": "train.shift: Input should be a finite number",
    "train.seed=-1": "train.seed: Input should be greater than or equal to 0",
    "train.device='tpu9'": "train.device: 'tpu9' is not a device",
    "offload.vram_budget_gb=nan": "offload.vram_budget_gb: Input should be a finite number",
    "train.optimizer_args.lr=1": "train.optimizer_args: 'lr' is set by train.learning_rate, not here",
    # checked before any model loads, not as a TypeError once the DiT is in memory
    "train.optimizer_args.betaz=[0.9, 0.99]": "train.optimizer_args.betaz: torch.optim.AdamW takes no 'betaz'",
}
FULL_FINETUNE = ("train.lora_rank=0", "train.trainable_models=['transformer']")
LORA_ONLY_KEYS = ["train.lora_narrow_inputs=true", "train.lora_alpha=8", "train.lora_target_modules=['to_q']"]


@pytest.mark.parametrize("override", list(CONFIG_CASES))
def test_out_of_range_config_values_name_the_dotted_key(cached, capsys, override):
    code, err = _cli(capsys, "train", cached / "config.toml", "--in-process", "--set", override)
    _assert_one_line(code, err, 2, CONFIG_CASES[override])


@pytest.mark.parametrize("override", LORA_ONLY_KEYS)
def test_lora_keys_under_full_finetuning_are_refused_not_ignored(cached, capsys, override):
    sets = [arg for key in (*FULL_FINETUNE, override) for arg in ("--set", key)]
    code, err = _cli(capsys, "train", cached / "config.toml", "--in-process", *sets)
    key = override.split("=")[0]
    _assert_one_line(code, err, 2, f"{key} applies to LoRA adapters", "full fine-tuning")


def _demo_model(cached: Path) -> Path:
    return Path(load_config(cached / "config.toml").model.path)


@pytest.mark.parametrize("verb, weights, damage, fragments", [
    ("train", "transformer/diffusion_pytorch_model.safetensors", "half",
     ["transformer: cannot load diffusion_pytorch_model.safetensors", "incomplete, corrupt"]),
    ("train", "transformer/diffusion_pytorch_model.safetensors", "missing",
     ["transformer: cannot load its weight files", "no file named"]),
    ("preprocess", "text_encoder/model.safetensors", "garbage",  # SafetensorError alone names no file
     ["text_encoder: cannot load model.safetensors (SafetensorError: Error while deserializing header"]),
])
def test_damaged_weights_name_the_folder_and_file(cached, data, capsys, tmp_path, verb, weights, damage, fragments):
    model = tmp_path / "model"
    shutil.copytree(_demo_model(cached), model)
    weights = model / weights
    if damage == "half":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(b"\xff" * 64)
    folder, args = data
    _rows(folder, "image,prompt\nok.png,x\n")
    extra = ["--in-process"] if verb == "train" else ["--part", 0, *args]
    code, err = _cli(capsys, verb, cached / "config.toml", *extra, "--set", f"model.path={model}",
                     "--set", f"output.path={tmp_path / 'out'}")
    _assert_one_line(code, err, 2, *fragments)


@pytest.mark.parametrize("damage, fragments", [
    ("no cache", ["no splitflow cache here", "run preprocess"]),
    ("manifest", ["missing", "unreadable manifests: run `splitflow cache verify`"]),
    ("entry", ["is unreadable"]),
])
def test_cache_errors_at_train_time_are_one_line(cached, capsys, tmp_path, damage, fragments):
    cache = tmp_path / "cache.zarr"
    # (a cache missing some of the config's rows: tests/stages/test_isolation.py)
    if damage != "no cache":
        shutil.copytree(cached / "cache.zarr", cache)
    if damage == "manifest":
        for manifest in (cache / "manifests").glob("*.json"):
            manifest.write_text("{not json")
    if damage == "entry":
        chunks = [p for p in (cache / "parts").rglob("*") if p.is_file() and p.suffix != ".json" and "zarr" not in p.name]
        for chunk in chunks:
            chunk.write_bytes(b"\x00" * chunk.stat().st_size)
    code, err = _cli(capsys, "train", cached / "config.toml", "--in-process", "--set", f"cache.url={cache}",
                     "--set", f"output.path={tmp_path / 'out'}")
    _assert_one_line(code, err, 2, *fragments)


def test_cache_verify_reports_a_corrupt_dataset_keys_file(cached, capsys, tmp_path):
    cache = tmp_path / "cache.zarr"
    shutil.copytree(cached / "cache.zarr", cache)
    (cache / "dataset-keys.json").write_text("{not json")
    code, err = _cli(capsys, "cache", "verify", cache)
    assert code == 2 and "Traceback" not in err
    assert "dataset      UNREADABLE" in capsys.out and "entries read, 1 bad" in capsys.out
    code, _ = _cli(capsys, "cache", "inspect", cache)
    assert code == 0 and "UNREADABLE" in capsys.out


def test_a_diverging_run_stops_and_writes_nothing_non_finite(cached, capsys, tmp_path):
    out = tmp_path / "out"
    code, err = _cli(capsys, "train", cached / "config.toml", "--in-process", "--set", f"output.path={out}",
                     "--set", "train.learning_rate=1e30", "--set", "train.max_grad_norm=1e30",
                     "--set", "train.max_steps=8", "--set", "train.save_steps=1")
    _assert_one_line(code, err, 2, "training stopped at step", "train.learning_rate (now 1e+30)")
    assert not (out / "lora.safetensors").exists()
    for path in out.glob("checkpoints/step-*/trainable.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(str(path)).values()), path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("optimizer_offload", [False, True])
def test_a_budget_too_small_exits_2_in_one_line_from_its_own_process(cached, tmp_path, device, optimizer_offload):
    """As a user runs it: its own process (a C++ thread left joinable at exit would print "terminate
    called" after the message, and only a process's exit shows that), nothing written."""
    out = tmp_path / "out"
    sets = [f"output.path={out}", f"train.device={device}", "offload.enable_model_cpu_offload=true",
            f"offload.enable_optimizer_cpu_offload={str(optimizer_offload).lower()}", "offload.vram_budget_gb=0.00001"]
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", str(cached / "config.toml"), "--in-process",
                           *[arg for key in sets for arg in ("--set", key)]],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    line = _assert_one_line(proc.returncode, proc.stderr, 2, "offload.vram_budget_gb = 0.0 MiB cannot hold",
                            "raise the budget")
    assert "terminate called" not in proc.stderr, line
    assert not (out / "lora.safetensors").exists() and not list(out.glob("checkpoints/step-*"))


# Runs inside a private mount namespace (unshare -m), so the tmpfs mounts vanish with the process even
# if the test is killed.  argv: config, cache, read-only folder, two small folders.  Prints one JSON object.
NAMESPACE_DRIVER = r"""
import json, os, subprocess, sys, io, contextlib
from pathlib import Path
from flows.cli import main

config, cache, ro, small, tiny = sys.argv[1:6]
def cli(*argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in argv])
    return {"code": code, "err": err.getvalue()}

subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", ro], check=True)
results = {"ro_train": cli("train", config, "--in-process", "--set", f"output.path={ro}/out")}
results["ro_cache"] = cli("preprocess", config, "--part", 0, "--set", f"cache.url={ro}/cache.zarr")
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", small], check=True)
out = Path(small) / "out"
results["first"] = cli("train", config, "--in-process", "--set", f"output.path={out}", "--set", "train.max_steps=2")
step = out / "checkpoints" / "step-00000002"
size = sum(f.stat().st_size for f in step.iterdir())
lora = (out / "lora.safetensors").read_bytes()
free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
(Path(small) / "filler").write_bytes(b"x" * (free - min(size // 2, 32 * 1024)))  # too little for a checkpoint
results["full"] = cli("train", config, "--in-process", "--set", f"output.path={out}", "--set", "train.max_steps=4")
results["after"] = {"latest": (out / "checkpoints" / "latest").read_text().strip(),
                    "left": sorted(p.name for p in (out / "checkpoints").iterdir()),
                    "lora_intact": (out / "lora.safetensors").read_bytes() == lora}
(Path(small) / "filler").unlink()
results["resumed"] = cli("train", config, "--in-process", "--set", f"output.path={out}", "--set", "train.max_steps=4")
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", tiny], check=True)  # a third of the cache fits
results["cache_full"] = cli("preprocess", config, "--part", 0, "--set", f"cache.url={tiny}/cache.zarr",
                            "--set", "preprocess.commit_every=2")
from cache_store import open_cache
kept = open_cache(f"{tiny}/cache.zarr")
results["cache_kept"] = {"entries": len(kept.keys()), "verified": kept.verify().ok}
print(json.dumps(results))
"""


def test_a_full_disk_and_read_only_folders_are_one_line_exit_3_and_lose_nothing(cached, tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -m (mount namespaces) to mount a full or read-only tmpfs")
    for name in ("ro", "small", "tiny"):
        (tmp_path / name).mkdir()
    run = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", NAMESPACE_DRIVER,
                          str(cached / "config.toml"), str(cached / "cache.zarr"), str(tmp_path / "ro"),
                          str(tmp_path / "small"), str(tmp_path / "tiny")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    _assert_one_line(results["ro_train"]["code"], results["ro_train"]["err"], 3, "read-only", str(tmp_path / "ro"))
    _assert_one_line(results["ro_cache"]["code"], results["ro_cache"]["err"], 3, "read-only", str(tmp_path / "ro"))
    assert results["first"]["code"] == 0
    _assert_one_line(results["full"]["code"], results["full"]["err"], 3,
                     "writing checkpoint", "step-00000004 failed, earlier checkpoints are intact", "disk is full")
    assert results["after"] == {"latest": "step-00000002", "left": ["latest", "step-00000002"], "lora_intact": True}
    assert results["resumed"]["code"] == 0  # space freed: training resumes from step 2 and finishes
    _assert_one_line(results["cache_full"]["code"], results["cache_full"]["err"], 3, "disk is full",
                     f"writing cache {tmp_path / 'tiny' / 'cache.zarr'}")
    assert results["cache_kept"]["entries"] >= 2 and results["cache_kept"]["verified"]  # committed entries stay
