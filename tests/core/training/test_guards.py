"""NaN/Inf steps are skipped and a streak stops the run; nothing non-finite is ever written; trainable
tensors that get no gradient are reported and left out of the optimizer, keeping resume exact (data
parallelism with such a layer: the "dead layer" case of test_data_parallel.py)."""

import copy
import logging

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_core.errors import InputError
from diffsynth_core.training.checkpoint import CheckpointManager
from diffsynth_core.training.loop import Trainer
from diffsynth_core.training.metrics import read_metrics
from stages.config import OffloadSection, TrainSection

from .toy import TOY_SPEC, ToyDiT, ToyWithDeadHead, lora_of, toy_samples


def _trainer(tmp_path, model, samples, **options):
    defaults = dict(lora_rank=4, max_steps=6, save_steps=2, learning_rate=1e-2, seed=5, gradient_checkpointing=False)
    return Trainer(TOY_SPEC, model, samples, TrainSection(**{**defaults, **options}), OffloadSection(), tmp_path,
                   progress=False)


def _checkpointed_tensors(root):
    return [t for path in sorted(root.glob("checkpoints/step-*/trainable.safetensors"))
            for t in load_file(str(path)).values()]


def test_a_nan_sample_skips_its_update_and_training_goes_on(tmp_path):
    torch.manual_seed(0)
    samples = toy_samples(6)
    samples[2] = {**samples[2], "latents": torch.full_like(samples[2]["latents"], float("nan"))}
    result = _trainer(tmp_path, ToyDiT(), samples, max_steps=6).fit()
    losses = [row["loss"] for row in read_metrics(tmp_path / "metrics.csv")]
    assert len(losses) == 6 and losses.count("nan") == 1  # one epoch: the bad sample came up once
    assert all(torch.isfinite(t).all() for t in lora_of(result.model).values())
    assert all(torch.isfinite(t).all() for t in _checkpointed_tensors(tmp_path))


def test_non_finite_steps_in_a_row_stop_the_run_naming_the_step(tmp_path):
    torch.manual_seed(0)
    samples = [{**s, "latents": torch.full_like(s["latents"], float("inf"))} for s in toy_samples(6)]
    trainer = _trainer(tmp_path, ToyDiT(), samples, save_steps=1, max_nonfinite_steps=2)
    with pytest.raises(InputError, match=r"training stopped at step 2: loss nan, 2 step\(s\) in a row with NaN/Inf "
                                         r"\(train.max_nonfinite_steps = 2\).*Lower train.learning_rate \(now 0.01\)"):
        trainer.fit()
    assert [int(r["step"]) for r in read_metrics(tmp_path / "metrics.csv")] == [1]
    assert all(torch.isfinite(t).all() for t in _checkpointed_tensors(tmp_path))


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(1, {"w": torch.ones(2)}, {}, {"step": 1})
    with pytest.raises(InputError, match=r"step-00000002: 1 of 2 tensors hold NaN or Inf \(e.g. \['bad'\]\); "
                                         r"nothing was written"):
        manager.save(2, {"w": torch.ones(2), "bad": torch.tensor([1.0, float("nan")])}, {}, {"step": 2})
    assert sorted(p.name for p in manager.root.iterdir()) == ["latest", "step-00000001"]


def test_folders_newer_than_latest_are_moved_aside_not_deleted(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(2, {"w": torch.ones(2)}, {}, {"step": 2})
    for step in (4, 6):  # a crash after the rename left step 4; a user copied a step 6 in
        manager.save(step, {"w": torch.full((2,), float(step))}, {}, {"step": step})
    (manager.root / "latest").write_text("step-00000002\n")
    manager.save(4, {"w": torch.zeros(2)}, {}, {"step": 4})
    orphans = sorted(p.name for p in (manager.root / "orphaned").iterdir())
    assert [name[:13] for name in orphans] == ["step-00000004", "step-00000006"]
    kept = [load_file(str(manager.root / "orphaned" / name / "trainable.safetensors"))["w"] for name in orphans]
    assert kept[0].tolist() == [4.0, 4.0] and kept[1].tolist() == [6.0, 6.0]  # the old contents, untouched
    assert manager.latest_step() == 4 and manager.load()["weights"]["w"].tolist() == [0.0, 0.0]


def test_tensors_without_gradient_are_reported_left_out_and_resume_stays_exact(tmp_path, caplog):
    torch.manual_seed(0)
    base = ToyWithDeadHead()
    targets = ["proj", "mod", "head"]
    with caplog.at_level(logging.WARNING):
        straight = _trainer(tmp_path / "straight", copy.deepcopy(base), toy_samples(),
                            lora_target_modules=targets).fit()
    warnings = [r.getMessage() for r in caplog.records if "get no gradient" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].endswith(": head")  # one line, naming the module
    assert load_file(str(tmp_path / "straight/checkpoints/step-00000006/trainable.safetensors"))  # written
    _trainer(tmp_path / "resumed", copy.deepcopy(base), toy_samples(), lora_target_modules=targets, max_steps=3).fit()
    resumed = _trainer(tmp_path / "resumed", copy.deepcopy(base), toy_samples(), lora_target_modules=targets).fit()
    expected, got = lora_of(straight.model), lora_of(resumed.model)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert not got["head.lora_B.default.weight"].any()  # LoRA B starts at zero and never moved
    saved = CheckpointManager(tmp_path / "resumed" / "checkpoints").load()
    assert saved["metadata"]["no_gradient"] == ["head.lora_A.default.weight", "head.lora_B.default.weight"]


def test_a_nan_step_writes_no_host_weight_under_optimizer_offload(tmp_path):
    """The bound host optimizer queues its steps only once the guard has seen every gradient:
    a step started during backward (overlap_backward) would write NaN into the host weights."""
    torch.manual_seed(0)
    samples = toy_samples(6)
    samples[0] = {**samples[0], "latents": torch.full_like(samples[0]["latents"], float("nan"))}
    offload = OffloadSection(enable_model_cpu_offload=True, enable_optimizer_cpu_offload=True)
    train = TrainSection(lora_rank=0, trainable_models=["transformer"], max_grad_norm=None, max_steps=6,
                         save_steps=0, learning_rate=1e-2, seed=5, gradient_checkpointing=False)
    result = Trainer(TOY_SPEC, ToyDiT(), samples, train, offload, tmp_path, progress=False).fit()
    assert result.offload.stepper is not None  # the host optimizer was bound
    losses = [row["loss"] for row in read_metrics(tmp_path / "metrics.csv")]
    assert losses.count("nan") == 1
    bad = [name for name, p in result.model.named_parameters() if not torch.isfinite(p).all()]
    result.offload.detach()
    assert bad == []
