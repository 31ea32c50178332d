import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cache_store import IncompleteCacheError
from diffsynth_core.training.metrics import read_metrics
from stages import preprocess, train

from .sigkill import train_until_first_checkpoint


def _overrides(cfg, *extra):
    return [f"dataset.base_path={cfg.dataset.base_path}", f"dataset.metadata_path={cfg.dataset.metadata_path}",
            f"model.path={cfg.model.path}", f"cache.url={cfg.cache_url}", f"output.path={cfg.output.path}", *extra]


def test_train_refuses_an_incomplete_cache(make_config):
    cfg = make_config("preprocess.parts=2")
    preprocess.run(cfg, 0)
    preprocess.finalize(cfg)
    with pytest.raises(IncompleteCacheError, match="missing"):
        train.run(cfg)
    assert not (cfg.output_dir / "checkpoints").exists()  # refused before any work


def test_a_sigkilled_training_resumes_to_the_same_lora_bit_for_bit(make_config, tmp_path):
    steps = ["train.max_steps=40", "train.save_steps=5"]
    cfg = make_config(*steps)
    preprocess.run(cfg)
    reference = make_config(*steps, f"output.path={tmp_path / 'reference'}")
    train.run(reference)

    killed_at = train_until_first_checkpoint(tmp_path, _overrides(cfg, *steps), cfg.output_dir)
    assert 5 <= killed_at < 40, killed_at

    summary = train.run(cfg)
    assert summary.resumed_from == killed_at and summary.steps == 40
    got = load_file(str(cfg.output_dir / "lora.safetensors"))
    expected = load_file(str(reference.output_dir / "lora.safetensors"))
    assert got.keys() == expected.keys()
    assert all(got[k].equal(expected[k]) for k in expected)
    rows = read_metrics(cfg.output_dir / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 41))
    assert [r["loss"] for r in rows] == [r["loss"] for r in read_metrics(reference.output_dir / "metrics.csv")]


def test_validation_images_are_rendered_every_k_steps_without_changing_the_run(make_config, tmp_path):
    steps = ["train.max_steps=4", "train.save_steps=0"]
    cfg = make_config(*steps, "train.validation_prompts=['a red circle']", "train.validation_steps=2",
                      "train.validation_inference_steps=2")
    preprocess.run(cfg)
    train.run(cfg)
    images = sorted(p.name for p in (cfg.output_dir / "validation").glob("*.png"))
    assert images == ["step-00000002-0.png", "step-00000004-0.png"]
    plain = make_config(*steps, f"output.path={tmp_path / 'plain'}")
    train.run(plain)
    got = load_file(str(cfg.output_dir / "lora.safetensors"))
    expected = load_file(str(plain.output_dir / "lora.safetensors"))
    assert all(got[k].equal(expected[k]) for k in expected)


@pytest.mark.parametrize("extra, reference", [
    (["offload.enable_model_cpu_offload=true"], []),
    (["offload.enable_model_cpu_offload=true", "offload.granularity='leaf'", "train.gradient_checkpointing_offload=true"],
     []),
    # the adapters live on the host with their blocks and step there (fused CPU AdamW), then export
    (["offload.enable_model_cpu_offload=true", "offload.enable_optimizer_cpu_offload=true"], []),
    # on a CPU run the optimizer's state is in host memory already: the key changes nothing
    (["offload.enable_model_cpu_offload=true", "offload.optimizer_state_on_host=true"], []),
    # each page steps during backward: no clipping (the key refuses it), and the reference steps with the
    # same fused kernel after backward
    (["offload.enable_model_cpu_offload=true", "offload.optimizer_step_in_backward=true", "train.max_grad_norm=0"],
     ["train.max_grad_norm=0", "train.optimizer_args.fused=true"]),
], ids=["block", "leaf+activation-offload", "optimizer-offload", "state-on-host", "step-in-backward"])
def test_training_under_the_offload_engine_equals_training_without_it(make_config, tmp_path, extra, reference):
    steps = ["train.max_steps=4", "train.save_steps=0"]
    plain = make_config(*steps, *reference, f"output.path={tmp_path / 'plain'}")
    preprocess.run(plain)
    train.run(plain)
    offloaded = make_config(*steps, *extra, f"output.path={tmp_path / 'offloaded'}")
    train.run(offloaded)
    got = load_file(str(offloaded.output_dir / "lora.safetensors"))
    expected = load_file(str(plain.output_dir / "lora.safetensors"))
    assert got.keys() == expected.keys()
    for k in expected:  # see _MMAP_NOTE for why this is close rather than bitwise
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-7)
    report = json.loads((offloaded.output_dir / "offload.json").read_text())
    if "offload.enable_optimizer_cpu_offload=true" in extra:  # the adapters really stepped on the host
        assert report["host_optimizer"]["jobs"] >= 4 and report["d2h_grad_bytes"] > 0
    if "offload.optimizer_step_in_backward=true" in extra:  # every step paged its state out
        pages = report["optimizer_step_in_backward"]
        assert pages["pages_stepped"] >= 4 and pages["d2h_bytes"] > 0


def test_rerunning_a_finished_run_keeps_its_offload_report(make_config):
    """A re-run that finds the run finished trains no step: the report measured by the run that
    trained stays as it was (an all-zero report must not replace it)."""
    cfg = make_config("train.max_steps=2", "train.save_steps=0", "offload.enable_model_cpu_offload=true")
    preprocess.run(cfg)
    train.run(cfg)
    measured = (cfg.output_dir / "offload.json").read_text()
    report = json.loads(measured)
    assert report["steps"] == 2 and report["h2d_bytes"] > 0
    again = train.run(cfg)
    assert again.resumed_from == again.steps == 2
    assert (cfg.output_dir / "offload.json").read_text() == measured


# Without offload, CPU training computes with the weights as loaded: views of the mmapped
# safetensors file, 8-byte aligned.  The engine copies them into its 64-byte aligned arena, and
# oneDNN's fp32 kernels round differently for the two alignments (last-ulp differences).  The
# engine's own tests (tests/core/offload) show bitwise equality on identically placed weights.
_MMAP_NOTE = None


def test_full_finetuning_with_optimizer_offload_equals_plain_full_finetuning(make_config, tmp_path):
    # A full fine-tuning rate, not the demo's LoRA rate: Adam's steps scale last-ulp gaps by the rate.
    steps = ["train.max_steps=3", "train.save_steps=0", "train.lora_rank=0", "train.trainable_models=['transformer']",
             "train.learning_rate=1e-3"]
    plain = make_config(*steps, f"output.path={tmp_path / 'plain'}")
    preprocess.run(plain)
    train.run(plain)
    offloaded = make_config(*steps, "offload.enable_model_cpu_offload=true", "offload.enable_optimizer_cpu_offload=true",
                            f"output.path={tmp_path / 'offloaded'}")
    train.run(offloaded)
    got = load_file(str(offloaded.output_dir / "transformer.safetensors"))
    expected = load_file(str(plain.output_dir / "transformer.safetensors"))
    assert got.keys() == expected.keys()
    original = load_file(str(plain.model.path) + "/transformer/diffusion_pytorch_model.safetensors")
    assert any(not expected[k].equal(original[k]) for k in original)  # full fine-tuning changed weights
    for k in expected:  # close, not bitwise: see _MMAP_NOTE (Adam's normalised steps amplify last-ulp gaps)
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-6)


def test_torchrun_with_two_gloo_ranks_trains_like_one_process_accumulating_two_samples(make_config, tmp_path):
    steps = ["train.max_steps=3", "train.save_steps=0", "train.max_grad_norm=0.5"]
    single = make_config(*steps, "train.gradient_accumulation_steps=2", f"output.path={tmp_path / 'single'}")
    preprocess.run(single)
    train.run(single)
    ranks = make_config(*steps, f"output.path={tmp_path / 'ranks'}")
    config_path = ranks.save(tmp_path / "ranks.toml")
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--standalone", "-m", "flows.cli", "train", str(config_path), "--in-process"],
                              cwd=os.getcwd(), capture_output=True, text=True, timeout=120)
    assert launched.returncode == 0, launched.stderr[-3000:]
    got = load_file(str(ranks.output_dir / "lora.safetensors"))
    expected = load_file(str(single.output_dir / "lora.safetensors"))
    for k in expected:  # all-reduce sums in another order than accumulation: equal up to rounding
        torch.testing.assert_close(got[k], expected[k], rtol=1e-4, atol=1e-6)
    assert [int(r["step"]) for r in read_metrics(ranks.output_dir / "metrics.csv")] == [1, 2, 3]


def test_the_training_stage_leaves_the_process_group_it_joined(tmp_path, monkeypatch):
    """What each torchrun rank relies on to exit cleanly; a group joined before is the caller's to keep."""
    import torch.distributed as dist

    from diffsynth_core.errors import InputError
    from stages.common import init_distributed, leaving_process_group

    monkeypatch.setenv("WORLD_SIZE", "1")  # one gloo rank: init_distributed leaves a single process alone...
    with leaving_process_group():
        assert init_distributed(torch.device("cpu")) == torch.device("cpu") and not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with leaving_process_group():  # ...so join as torchrun's ranks do, within the block
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        assert init_distributed(torch.device("cpu")) == torch.device("cpu")  # already joined: kept
    assert not dist.is_initialized()
    with pytest.raises(InputError), leaving_process_group():  # a failed gloo rank leaves it too
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store1"), 1), rank=0, world_size=1)
        raise InputError("sample 3: unreadable")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store2"), 1), rank=0, world_size=1)
    try:
        with leaving_process_group():
            pass
        assert dist.is_initialized()  # joined before the block: not ours to leave
    finally:
        dist.destroy_process_group()
