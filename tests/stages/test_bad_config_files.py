"""Config, metadata, LoRA and checkpoint files that used to train wrong with exit 0 or reach the bug path:
each is one line naming the file or key, exit 2."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stages.config import build_config

from .one_line import assert_one_line, cli

# Each case: file name, bytes, fragments of the one line
FILES = {
    "key twice in YAML": ("run.yaml", b"train:\n  learning_rate: 1.0e-4\n  learning_rate: 2.0e-4\n",
                          ["key 'learning_rate' appears twice", "line 3"]),
    "key twice in JSON": ("run.json", b'{"train": {"seed": 1, "seed": 2}}', ["key 'seed' appears twice"]),
    "YAML list": ("run.yaml", b"- train\n- model\n", ["holds a list, not a table of sections"]),
    "JSON list": ("run.json", b"[1, 2]", ["holds a list, not a table of sections"]),
    "Latin-1 byte": ("run.toml", "[train]\nseed = 1 # café\n".encode("latin-1"),
                     ["byte 0xe9 on line 2 is not UTF-8", "save it as UTF-8"]),
    "TOML date": ("run.toml", b"[train]\nseed = 2024-01-01\n", ["train.seed: 2024-01-01 is a date"]),
    "YAML date": ("run.yaml", b"output:\n  path: 2024-01-01\n", ["output.path: 2024-01-01 is a date",
                                                                  "put it in quotes"]),
    "no targets": ("run.toml", b"[train]\nlora_target_modules = []\n",
                   ["train.lora_target_modules: an empty list names no module"]),
    "LBFGS": ("run.toml", b'[train]\noptimizer = "LBFGS"\n', ["train.optimizer = 'LBFGS' cannot train here",
                                                              "needs a closure"]),
    "SparseAdam": ("run.toml", b'[train]\noptimizer = "torch.optim.SparseAdam"\n', ["sparse gradients only"]),
}


@pytest.mark.parametrize("case", list(FILES))
def test_a_bad_config_file_is_one_line_exit_2(tmp_path, capsys, case):
    name, content, fragments = FILES[case]
    (tmp_path / name).write_bytes(content)
    code, err = cli(capsys, "train", tmp_path / name, "--in-process")
    assert_one_line(code, err, 2, *fragments)


def test_output_path_naming_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "out").write_text("a file")
    (tmp_path / "run.toml").write_text("[train]\nseed = 1\n")
    code, err = cli(capsys, "train", tmp_path / "run.toml", "--in-process", "--set", f"output.path={tmp_path / 'out'}")
    assert_one_line(code, err, 2, f"output.path: {tmp_path / 'out'} is a file, not a folder")


def test_a_home_relative_output_path_is_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = build_config({"output": {"path": "~/out"}, "cache": {"url": "~/cache.zarr"}})
    assert cfg.output_dir == tmp_path / "out" and cfg.cache_url == str(tmp_path / "cache.zarr")


@pytest.mark.parametrize("suffix, content, fragments", [
    (".jsonl", b'{"image": "ok.png", "prompt": "a", "prompt": "b"}\n', ["key 'prompt' appears twice"]),
    (".json", b'[{"image": "ok.png", "image": "other.png", "prompt": "a"}]', ["key 'image' appears twice"]),
    (".jsonl", '{"image": "ok.png", "prompt": "caf\u00e9"}\n'.encode("latin-1"), ["line 1: byte 0xe9 is not UTF-8"]),
], ids=["JSONL key twice", "JSON key twice", "JSONL Latin-1"])
def test_bad_metadata_files_are_one_line_exit_2(preprocessed_demo, tmp_path, capsys, suffix, content, fragments):
    shutil.copy(next((preprocessed_demo / "dataset").glob("*.png")), tmp_path / "ok.png")
    (tmp_path / f"metadata{suffix}").write_bytes(content)
    code, err = cli(capsys, "preprocess", preprocessed_demo / "config.toml", "--part", 0,
                    "--set", f"dataset.base_path={tmp_path}",
                    "--set", f"dataset.metadata_path={tmp_path / f'metadata{suffix}'}",
                    "--set", f"cache.url={tmp_path / 'cache.zarr'}", "--set", f"output.path={tmp_path / 'out'}")
    assert_one_line(code, err, 2, f"metadata{suffix}", *fragments)


def test_wide_tiffs_decode_to_their_picture_not_black(tmp_path):
    """Float (0-1) and 32-bit integer TIFFs read as the 8-bit picture they hold, as a 16-bit PNG does."""
    from diffsynth_core.data.media import read_image

    ramp = np.linspace(0, 1, 32 * 32).reshape(32, 32)
    Image.fromarray(ramp.astype(np.float32), "F").save(tmp_path / "float.tif")
    Image.fromarray((ramp * (2**31 - 1)).astype(np.int32), "I").save(tmp_path / "int32.tif")
    Image.fromarray((ramp * 65535).astype(np.uint16)).save(tmp_path / "uint16.png")
    expected = np.asarray(read_image(tmp_path / "uint16.png"))
    assert expected.max() == 255 and expected.min() == 0
    for name in ("float.tif", "int32.tif"):
        got = np.asarray(read_image(tmp_path / name)).astype(int)
        assert np.abs(got - expected).max() <= 1, name


def test_a_float_image_out_of_any_brightness_range_is_refused(tmp_path):
    from diffsynth_core.data.media import MediaError, read_image

    Image.fromarray(np.full((16, 16), 4000.0, np.float32), "F").save(tmp_path / "hdr.tif")
    with pytest.raises(MediaError, match="float image with values from 4000 to 4000"):
        read_image(tmp_path / "hdr.tif")


def _broken_header(path: Path, how: str) -> Path:
    """A LoRA file whose header lies: its length 2^62, or a tensor's offsets past the end of the file."""
    if how == "length":
        path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    else:
        header = json.dumps({"a.lora_A.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
        path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    return path


@pytest.mark.parametrize("key", ["train.lora_checkpoint", "train.preset_lora_path"])
@pytest.mark.parametrize("how", ["length", "offsets"])
def test_a_lora_file_with_a_broken_header_is_one_line_exit_2(preprocessed_demo, tmp_path, capsys, key, how):
    lora = _broken_header(tmp_path / "broken.safetensors", how)
    code, err = cli(capsys, "train", preprocessed_demo / "config.toml", "--in-process",
                    "--set", f"output.path={tmp_path / 'out'}", "--set", f"{key}={lora}")
    assert_one_line(code, err, 2, f"LoRA file {lora} cannot be read", "give a whole .safetensors LoRA")


def test_a_lora_rank_past_every_layer_is_one_line_exit_2(preprocessed_demo, tmp_path, capsys):
    code, err = cli(capsys, "train", preprocessed_demo / "config.toml", "--in-process",
                    "--set", f"output.path={tmp_path / 'out'}", "--set", "train.lora_rank=1e9")
    assert_one_line(code, err, 2, "train.lora_rank = 1000000000 exceeds the widest target layer's rank")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize("name", ["state.pt", "optimizer.pt"])
def test_pickled_code_in_a_checkpoint_is_refused_as_input(preprocessed_demo, tmp_path, capsys, name):
    out = tmp_path / "out"
    args = ["train", preprocessed_demo / "config.toml", "--in-process", "--set", f"output.path={out}"]
    assert cli(capsys, *args, "--set", "train.max_steps=1")[0] == 0
    target = out / "checkpoints" / "step-00000001" / name
    target.write_bytes(pickle.dumps(_Exploit()))
    code, err = cli(capsys, *args, "--set", "train.max_steps=2")
    assert_one_line(code, err, 2, f"checkpoint file {target} cannot be loaded safely", "pickled code?")
    assert not (Path.cwd() / "pwned").exists()


def test_a_diverged_run_of_two_steps_exports_nothing(preprocessed_demo, tmp_path, capsys):
    """A learning rate of 1e30 steps weights to 1e30 without a NaN: the final export refuses them."""
    out = tmp_path / "out"
    code, err = cli(capsys, "train", preprocessed_demo / "config.toml", "--in-process", "--set", f"output.path={out}",
                    "--set", "train.learning_rate=1e30", "--set", "train.max_steps=2")
    assert_one_line(code, err, 2, "beyond any trained model's", "the run diverged and nothing was written",
                    "train.learning_rate (now 1e+30)")
    assert not (out / "lora.safetensors").exists()


def test_a_temporary_file_left_by_a_killed_export_is_removed_by_the_next(tmp_path):
    import subprocess
    import sys

    import torch

    from diffsynth_core.models.lora_export import write_safetensors

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID no process holds now
    stale = tmp_path / f".lora.safetensors.tmp-{dead.pid}"
    stale.write_bytes(b"half a file")
    write_safetensors(tmp_path / "lora.safetensors", {"w": torch.zeros(2)}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors"]


def test_a_cache_url_without_its_filesystem_package_is_exit_3_not_retried(preprocessed_demo, tmp_path, capsys):
    """gcs:// stands in for s3:// without s3fs: fsspec knows the protocol, its package is not installed."""
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    code, err = cli(capsys, "train", preprocessed_demo / "config.toml", "--in-process",
                    "--set", "cache.url='gcs://bucket/cache.zarr'", "--set", f"output.path={tmp_path / 'out'}")
    assert_one_line(code, err, 3, "cache gcs://bucket/cache.zarr", "gcsfs", "pip install")


def test_released_weights_whose_class_refuses_the_derived_config_are_input(tmp_path):
    """A VAE too narrow for FLUX's 32 GroupNorm groups: the file is named, as input (exit 2), not retried as exit 3."""
    import torch
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from diffsynth_core.errors import InputError
    from diffsynth_core.models.flux_released import FORMATS
    from diffsynth_core.models.released import find_format, load_component
    from tests.core.models.released_layouts import ldm_vae_names

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 8], layers_per_block=1,
                        norm_num_groups=4)
    file = tmp_path / "ae.safetensors"
    save_file({k: v.contiguous() for k, v in ldm_vae_names(vae.state_dict()).items()}, str(file))
    fmt = find_format(FORMATS, "vae", [file])
    with pytest.raises(InputError, match=f"{file}: AutoencoderKL cannot be built from the config its shapes give"):
        load_component(fmt, [file], torch.float32)
