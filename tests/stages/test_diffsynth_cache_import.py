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
from diffsynth_core.errors import InputError
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


def z_image_sample(i):
    """diffsynth/pipelines/z_image.py: prompt_embeds is a list of the prompt's own (L, D) tokens."""
    g = torch.Generator().manual_seed(i)
    shared = _common(g, (1, 16, 4, 6), 32, 48)
    shared.update(input_image=PIL.Image.new("RGB", (48, 32), (i, 9, 9)), edit_image=None)
    posi = {"prompt": f"caption {i}", "prompt_embeds": [torch.randn(5 + i, TEXT_DIM, generator=g).to(torch.bfloat16)]}
    return shared, posi, {"negative_prompt": "", "prompt_embeds": [torch.zeros(3, TEXT_DIM, dtype=torch.bfloat16)]}


def qwen21_sample(i):
    """diffsynth/pipelines/qwen_image_21.py (wheel 2.1.12): even files are edit rows with one 32x32 reference,
    edit_latents a list of (1, 64, 2, 2) and one image slot in the prompt; prompt_embeds_mask None (one
    sample: nothing padded)."""
    g = torch.Generator().manual_seed(i)
    shared = _common(g, (1, 64, 2, 4), 32, 64)
    shared.update(input_image=PIL.Image.new("RGBA", (64, 32), (i, 9, 9, 255)), edit_image=None)
    length = 6 + i
    pad = torch.zeros(1, length, dtype=torch.bool)
    if i % 2 == 0:
        shared.update(edit_image=[PIL.Image.new("RGBA", (32, 32), (9, i, 9, 255))],
                      edit_latents=[torch.randn(1, 64, 2, 2, generator=g).to(torch.bfloat16)])
        pad[0, 2] = True  # <|image_pad|>: one slot per 2x2 reference latents
    posi = {"prompt": f"caption {i}", "prompt_embeds": torch.randn(1, length, 128, generator=g).to(torch.bfloat16),
            "prompt_embeds_mask": None, "edit_image_pad_mask": pad}
    return shared, posi, {"negative_prompt": "", **{k: v for k, v in posi.items() if k != "prompt"}}


SAMPLES = {"qwen_image": qwen_sample, "flux": flux_sample, "wan": wan_sample, "z_image": z_image_sample,
           "qwen_image21": qwen21_sample}


def _diffsynth_cache(folder: Path, family: str, n: int = 3) -> Path:
    for i in range(n):
        rank = i % 2  # two data_process ranks, local indices restarting at 0
        (folder / str(rank)).mkdir(parents=True, exist_ok=True)
        torch.save(SAMPLES[family](i), folder / str(rank) / f"{i // 2}.pth")
    return folder


def _transformer_only_model(family, folder, variant=None):
    """A model folder holding just the tiny DiT: all that stage 2 loads."""
    spec = get_family(family, variant)
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
    fields = {k: v for k, v in get_family(family).diffsynth_cache_fields.items() if "{i}" not in v}  # not edits
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


def _expected(family, i):
    """Sample ``i`` as our own stage 1 caches it: no batch dim, a frame axis on latents, masks of ones."""
    shared, posi, _ = SAMPLES[family](i)
    if family == "z_image":
        embeds = posi["prompt_embeds"][0]
        return {"latents": shared["input_latents"][0][:, None], "prompt_embeds": embeds,
                "prompt_embeds_mask": torch.ones(len(embeds), dtype=torch.long)}
    out = {"latents": shared["input_latents"][0][:, None], "prompt_embeds": posi["prompt_embeds"][0],
           "image_pad_mask": posi["edit_image_pad_mask"][0],
           "prompt_embeds_mask": torch.ones(posi["prompt_embeds"].shape[1], dtype=torch.long)}
    out.update({f"ref_latents_{n}": ref[0][:, None] for n, ref in enumerate(shared.get("edit_latents") or [])})
    return out


@pytest.mark.parametrize("family", ["z_image", "qwen_image21"])
def test_list_inputs_and_unstored_masks_import_as_our_own_entries_and_train_in_batches(family, tmp_path):
    """Z-Image caches its prompt as a list; Qwen-Image-2.1 its edit latents as a list and no prompt mask.
    Imported, each entry is what our stage 1 writes; batches pad prompts of different lengths under their
    masks, so a batch's prediction is each sample's alone."""
    from diffsynth_core.training.batching import stack_entries, to_device

    src = _diffsynth_cache(tmp_path / "models", family, n=4)
    summary = import_cache(str(src), str(tmp_path / "cache.zarr"))  # Qwen-Image-2.1's inputs hold Z-Image's
    assert summary["family"] == family and summary["imported"] == 4
    store = open_cache(tmp_path / "cache.zarr")
    entries = [store.get(key) for key in store.require_complete()]  # rank 0 holds files 0 and 2, rank 1 1 and 3
    for entry, i in zip(entries, (0, 2, 1, 3)):
        expected = _expected(family, i)
        assert set(entry) - {"meta"} == set(expected), i
        for name, tensor in expected.items():
            assert torch.equal(entry[name], tensor), (i, name)

    spec = get_family(family)
    transformer = spec.build_transformer("tiny", torch.float32, "cpu")

    def predict(group, sigmas):
        batch = to_device(stack_entries(group, spec.batch_padding), torch.device("cpu"), torch.float32)
        latents = batch.pop("latents")
        return spec.dit_forward(transformer, latents, torch.tensor(sigmas), batch)

    pairs = [(entries[0], entries[1])] + ([(entries[2], entries[3])] if family == "qwen_image21" else [])
    for first, second in pairs:  # prompts two tokens apart in length: the shorter one padded
        together = predict([first, second], [0.3, 0.7])
        assert torch.allclose(together, torch.cat([predict([first], [0.3]), predict([second], [0.7])]), atol=1e-5)

    model = _transformer_only_model(family, tmp_path / "model")
    variant = {"variant": "base"} if family == "z_image" else {}  # a bare tiny DiT does not tell base from Turbo
    cfg = build_config({"model": {"family": family, "path": str(model), "dtype": "float32", **variant},
                        "cache": {"url": str(tmp_path / "cache.zarr")},
                        "train": {"max_steps": 3, "lora_rank": 4, "device": "cpu", "learning_rate": 1e-3,
                                  "batch_size": 2},
                        "output": {"path": str(tmp_path / "out"), "export_every": "end"}})
    result = train.run(cfg)
    assert result.steps == 3 and torch.isfinite(torch.tensor(result.final_loss))


@pytest.mark.parametrize("variant, sizes", [("edit", [(2, 2)]), ("edit-2509", [(2, 2), (4, 2)])])
def test_qwen_image_edit_rows_import_with_their_reference_latents_and_train(variant, sizes, tmp_path, monkeypatch,
                                                                           capsys):
    """DiffSynth's Qwen-Image-Edit rows cache edit_latents: one tensor (Edit v1) or a list (2509, 2511).
    Imported, they are the rows' ref_latents_<i>, as our stage 1 writes them, and the edit model trains."""
    def sample(i):
        shared, posi, nega = qwen_sample(i)
        g = torch.Generator().manual_seed(100 + i)
        refs = [torch.randn(1, 16, h, w, generator=g).to(torch.bfloat16) for h, w in sizes]
        shared.update(edit_latents=refs[0] if variant == "edit" else refs, edit_image=None)
        return shared, posi, nega

    for i in range(2):
        (tmp_path / "models" / "0").mkdir(parents=True, exist_ok=True)
        torch.save(sample(i), tmp_path / "models" / "0" / f"{i}.pth")
    import_cache(str(tmp_path / "models"), str(tmp_path / "cache.zarr"))
    store = open_cache(tmp_path / "cache.zarr")
    for i, key in enumerate(store.require_complete()):
        shared, posi, _ = sample(i)
        entry = store.get(key)
        refs = shared["edit_latents"] if isinstance(shared["edit_latents"], list) else [shared["edit_latents"]]
        assert set(entry) - {"meta"} == {"latents", "prompt_embeds", "prompt_embeds_mask"} | {
            f"ref_latents_{n}" for n in range(len(sizes))}
        for n, ref in enumerate(refs):
            assert torch.equal(entry[f"ref_latents_{n}"], ref[0][:, None])  # (16, 1, h, w), as stage 1 writes

    model = _transformer_only_model("qwen_image", tmp_path / "model", variant)
    cfg = build_config({"model": {"family": "qwen_image", "variant": variant, "path": str(model), "dtype": "float32"},
                        "cache": {"url": str(tmp_path / "cache.zarr")},
                        "train": {"max_steps": 2, "lora_rank": 4, "device": "cpu", "learning_rate": 1e-3},
                        "output": {"path": str(tmp_path / "out"), "export_every": "end"}})
    result = train.run(cfg)
    assert result.steps == 2 and torch.isfinite(torch.tensor(result.final_loss))

    # The text-to-image model (or Edit v1, for 2509's two references) would take the references as extra image
    # tokens without a word: refused, naming the file and the variant to set.
    other = "text-to-image" if variant == "edit" else "edit"
    model = _transformer_only_model("qwen_image", tmp_path / other, None if other == "text-to-image" else other)
    cfg = build_config({"model": {"family": "qwen_image", "path": str(model), "dtype": "float32"},
                        "cache": {"url": str(tmp_path / "cache.zarr")}, "train": {"max_steps": 2, "device": "cpu"},
                        "output": {"path": str(tmp_path / f"out-{other}")}})
    with pytest.raises(InputError, match=r"0/0\.pth holds \d reference latents .* set model.variant"):
        train.run(cfg)
    # The CLI says it from disk, before a Prefect session starts.
    import flows.orchestrate
    from flows.cli import main

    def no_prefect(*args, **kwargs):
        raise AssertionError("a Prefect session started before the cache was checked")

    monkeypatch.setattr(flows.orchestrate, "prefect_session", no_prefect)
    assert main(["train", str(cfg.save(tmp_path / "wrong-model.toml"))]) == 2
    assert "0/0.pth holds" in capsys.readouterr().err


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
