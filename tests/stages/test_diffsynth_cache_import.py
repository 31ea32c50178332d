"""`splitflow cache import` of DiffSynth-Studio split-training caches, then training on them.

Each family's cache is built here as DiffSynth's ``sft:data_process`` task writes it: one
``torch.save((inputs_shared, inputs_posi, inputs_nega), "<rank>/<i>.pth")`` per sample, with the
field names and shapes its pipeline units produce (diffsynth/pipelines/qwen_image.py,
flux_image.py, wan_video.py; the ``get_pipeline_inputs`` of examples/*/model_training/train.py),
PIL images and a torch.device included, at the tiny models' widths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest
import torch

from cache_store import CacheFormatError, open_cache
from diffsynth_core.models import get_family
from stages import train
from stages.compat.diffsynth_cache import import_cache
from stages.config import build_config

REPO = Path(__file__).resolve().parents[2]
TEXT_DIM = 32  # joint_attention_dim / text_dim of the tiny models


def _common(g, shape, height, width):
    noise = torch.randn(shape, generator=g).to(torch.bfloat16)
    return {"height": height, "width": width, "cfg_scale": 1, "rand_device": torch.device("cpu"),
            "use_gradient_checkpointing": True, "use_gradient_checkpointing_offload": False,
            "noise": noise, "latents": noise,  # DiffSynth's latents are the noise in training mode
            "input_latents": torch.randn(shape, generator=g).to(torch.bfloat16)}


def qwen_sample(i):
    g = torch.Generator().manual_seed(i)
    shared = _common(g, (1, 16, 4, 6), 32, 48)
    shared.update(input_image=PIL.Image.new("RGB", (48, 32), (i, 9, 9)), edit_image_auto_resize=True,
                  zero_cond_t=False)
    emb = torch.randn(1, 5 + i, TEXT_DIM, generator=g).to(torch.bfloat16)
    mask = torch.ones(1, 5 + i, dtype=torch.int64)
    posi = {"prompt": f"caption {i}", "prompt_emb": emb, "prompt_emb_mask": mask}
    return shared, posi, {"negative_prompt": "", "prompt_emb": emb, "prompt_emb_mask": mask}


def flux_sample(i):
    g = torch.Generator().manual_seed(i)
    shared = _common(g, (1, 16, 4, 6), 32, 48)
    shared.update(input_image=PIL.Image.new("RGB", (48, 32), (9, i, 9)), embedded_guidance=1,
                  t5_sequence_length=8, tiled=False, image_ids=torch.zeros(1, 6, 3, dtype=torch.bfloat16),
                  guidance=torch.tensor([1.0], dtype=torch.bfloat16))
    posi = {"prompt": f"caption {i}", "prompt_emb": torch.randn(1, 8, TEXT_DIM, generator=g).to(torch.bfloat16),
            "pooled_prompt_emb": torch.randn(1, TEXT_DIM, generator=g).to(torch.bfloat16),
            "text_ids": torch.zeros(1, 8, 3, dtype=torch.bfloat16)}
    return shared, posi, {"negative_prompt": "", **{k: v for k, v in posi.items() if k != "prompt"}}


def wan_sample(i):
    g = torch.Generator().manual_seed(i)
    shared = _common(g, (1, 16, 2, 4, 4), 32, 32)
    shared.update(input_video=[PIL.Image.new("RGB", (32, 32), (9, 9, i))] * 5, num_frames=5, tiled=False,
                  cfg_merge=False, vace_scale=1, max_timestep_boundary=1.0, min_timestep_boundary=0.0)
    context = torch.randn(1, 8, TEXT_DIM, generator=g).to(torch.bfloat16)
    context[:, 5:] = 0  # zero past the prompt's tokens, as its PromptEmbedder does
    return shared, {"prompt": f"caption {i}", "context": context}, {"negative_prompt": "", "context": context}


SAMPLES = {"qwen_image": qwen_sample, "flux": flux_sample, "wan": wan_sample}


def _diffsynth_cache(folder: Path, family: str, n: int = 3) -> Path:
    for i in range(n):
        rank = i % 2  # two data_process ranks, local indices restarting at 0
        (folder / str(rank)).mkdir(parents=True, exist_ok=True)
        torch.save(SAMPLES[family](i), folder / str(rank) / f"{i // 2}.pth")
    return folder


def _transformer_only_model(family, folder):
    """A model folder holding just the tiny DiT: all that stage 2 loads."""
    spec = get_family(family)
    transformer = spec.build_transformer("tiny", torch.float32, "cpu")
    transformer.save_pretrained(folder / spec.transformer_component)
    index = {"_class_name": spec.pipeline_class_name,
             spec.transformer_component: ["diffusers", type(transformer).__name__]}
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("family", ["qwen_image", "flux", "wan"])
def test_an_imported_diffsynth_cache_trains(family, tmp_path):
    src = _diffsynth_cache(tmp_path / "models", family)
    summary = import_cache(str(src), str(tmp_path / "cache.zarr"))  # family recognised from the tensors
    assert summary["family"] == family and summary["imported"] == 3

    store = open_cache(tmp_path / "cache.zarr")
    assert store.family == family  # recorded: a config of another family is refused at train time
    keys = store.require_complete()
    shared, posi, _ = SAMPLES[family](1)  # rank 1, file 0.pth: the second key in (rank, index) order
    entry = store.get(keys[2])
    fields = get_family(family).diffsynth_cache_fields
    assert set(entry) - {"meta"} == set(fields.values())
    latents = shared["input_latents"][0]
    assert torch.equal(entry["latents"], latents if latents.dim() == 4 else latents[:, None])
    for source, name in fields.items():
        if name != "latents":
            assert torch.equal(entry[name], {**shared, **posi}[source][0]), name
    assert entry["meta"]["height"] == shared["height"] and "noise" not in entry

    model = _transformer_only_model(family, tmp_path / "model")
    cfg = build_config({"model": {"family": family, "path": str(model), "dtype": "float32"},
                        "cache": {"url": str(tmp_path / "cache.zarr")},
                        "train": {"max_steps": 3, "lora_rank": 4, "device": "cpu", "learning_rate": 1e-3},
                        "output": {"path": str(tmp_path / "out"), "export_every": "end"}})
    result = train.run(cfg)
    assert result.steps == 3 and result.final_loss is not None and torch.isfinite(torch.tensor(result.final_loss))
    assert Path(result.exports["diffusers"]).is_file()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flows.cli", "cache", "import", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_cache_import_cli_and_a_wrong_family_named(tmp_path):
    src = _diffsynth_cache(tmp_path / "models", "flux", n=2)
    done = _cli(str(src), str(tmp_path / "cache.zarr"))
    assert done.returncode == 0, done.stderr
    assert "imported 2 of 2 DiffSynth samples (flux" in done.stdout

    with pytest.raises(CacheFormatError, match=r"0/0\.pth: no tensor 'context'"):  # an InputError: exit 2
        import_cache(str(src), str(tmp_path / "wan.zarr"), family="wan")
    wan = build_config({"model": {"family": "wan", "path": str(tmp_path / "no-model")},
                        "cache": {"url": str(tmp_path / "cache.zarr")}, "output": {"path": str(tmp_path / "out")}})
    with pytest.raises(CacheFormatError, match="family 'flux'.*family 'wan'"):
        train.run(wan)
    with pytest.raises(CacheFormatError, match="nowhere does not exist"):  # an InputError: exit 2
        import_cache(str(tmp_path / "nowhere"), str(tmp_path / "x.zarr"))


def test_a_fifo_in_a_diffsynth_cache_folder_is_named_not_read(tmp_path):
    """`cache import` never opens it (a FIFO would block its reader forever): one line, exit 2, at once."""
    src = _diffsynth_cache(tmp_path / "models", "flux", n=1)
    fifo = src / "0" / "7.pth"
    os.mkfifo(fifo)
    done = _cli(str(src), str(tmp_path / "cache.zarr"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{fifo} is not a regular file" in done.stderr.strip().splitlines()[-1]
