"""Bringing a DiffSynth-Studio split-training cache (<rank>/<i>.pth) in, without running its pickles."""

from __future__ import annotations

import os
from pathlib import Path

import PIL.Image
import pytest
import torch

from cache_store import CacheFormatError, open_cache
from cache_store.diffsynth import import_diffsynth_cache, load_diffsynth_file
from cache_store.report import format_inspect, inspect_cache

MARKER = Path("/tmp") / f"splitflow-pwned-{os.getpid()}"


def diffsynth_sample(i: int) -> tuple:
    """What DiffSynth's Qwen-Image data_process task pickles (ANCHOR.md §2.3), at tiny sizes."""
    g = torch.Generator().manual_seed(i)
    noise = torch.randn(1, 16, 4, 6, generator=g).to(torch.bfloat16)
    emb = torch.randn(1, 5 + i, 32, generator=g).to(torch.bfloat16)
    mask = torch.ones(1, 5 + i, dtype=torch.int64)
    shared = {"cfg_scale": 1, "rand_device": torch.device("cpu"), "use_gradient_checkpointing": True,
              "input_image": PIL.Image.new("RGB", (48, 32), (i, 2 * i, 3)), "height": 32, "width": 48,
              "noise": noise, "latents": noise,
              "input_latents": torch.randn(1, 16, 4, 6, generator=g).to(torch.bfloat16)}
    posi = {"prompt": f"caption {i}", "prompt_emb": emb, "prompt_emb_mask": mask}
    nega = {"negative_prompt": "", "prompt_emb": emb, "prompt_emb_mask": mask}
    return shared, posi, nega


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


@pytest.fixture
def diffsynth_dir(tmp_path):
    src = tmp_path / "models"
    for rank, indices in ((0, range(3)), (1, range(2))):
        (src / str(rank)).mkdir(parents=True)
        for i in indices:
            torch.save(diffsynth_sample(10 * rank + i), src / str(rank) / f"{i}.pth")
    return src


def test_import_copies_tensors_and_values(diffsynth_dir, tmp_path):
    summary = import_diffsynth_cache(diffsynth_dir, str(tmp_path / "cache"))
    assert summary["files"] == 5 and summary["imported"] == 5
    store = open_cache(tmp_path / "cache")
    keys = store.require_complete()
    assert keys == summary["keys"] and len(keys) == 5  # (rank, index) order
    entry = store.get(keys[3])  # rank 1, file 0.pth -> sample 10
    shared, posi, _ = diffsynth_sample(10)
    assert torch.equal(entry["latents"], shared["input_latents"][0][:, None])  # frame axis added
    assert torch.equal(entry["prompt_embeds"], posi["prompt_emb"][0])
    assert entry["prompt_embeds_mask"].dtype == torch.int64 and entry["prompt_embeds"].dtype == torch.bfloat16
    assert "noise" not in entry
    meta = entry["meta"]
    assert meta["prompt"] == "caption 10" and meta["height"] == 32 and meta["source"] == "1/0.pth"
    assert set(meta["dropped"]) == {"rand_device", "input_image"}
    assert import_diffsynth_cache(diffsynth_dir, str(tmp_path / "cache"))["imported"] == 0  # re-run: nothing


def test_a_pickle_with_code_is_refused_and_never_run(diffsynth_dir, tmp_path):
    bad = diffsynth_dir / "1" / "1.pth"
    shared, posi, nega = diffsynth_sample(11)
    torch.save(({**shared, "hook": RunsCode()}, posi, nega), bad)
    with pytest.raises(CacheFormatError, match=r"1/1\.pth: UnpicklingError: pickle wants posix\.system"):
        import_diffsynth_cache(diffsynth_dir, str(tmp_path / "cache"), commit_every=2)
    assert not MARKER.exists()
    store = open_cache(tmp_path / "cache")
    assert len(store.keys()) == 4 and store.verify().errors == []  # what came before is intact

    legacy = diffsynth_dir / "legacy.pth"  # the old non-zip torch.save format goes the same way
    torch.save({"x": RunsCode()}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CacheFormatError, match="legacy.pth.*posix.system"):
        load_diffsynth_file(legacy)
    assert not MARKER.exists()


def test_truncated_diffsynth_file_is_named(diffsynth_dir, tmp_path):
    f = diffsynth_dir / "0" / "2.pth"
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(CacheFormatError, match=r"0/2\.pth"):
        import_diffsynth_cache(diffsynth_dir, str(tmp_path / "cache"))


def test_inspect_recognises_a_diffsynth_folder(diffsynth_dir, tmp_path):
    info = inspect_cache(str(diffsynth_dir))
    assert info["kind"] == "diffsynth" and info["files"] == 5 and not info["ok"]
    assert "import_diffsynth_cache" in format_inspect(info)
    with pytest.raises(CacheFormatError, match="not a splitflow cache.*DiffSynth"):
        open_cache(diffsynth_dir, "a")  # never write our files into someone's model folder
