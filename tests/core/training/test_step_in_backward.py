"""``offload.optimizer_step_in_backward`` through the Trainer (CPU): each page of trainable weights
steps during backward (``StepInBackward``, paging host to host here).  With no clipping the run is
bitwise the fused optimizer stepping after backward, a resumed run ends bitwise where a straight one
does, a NaN/Inf step writes nothing, and what cannot run with it is refused in one line, both when
the config is read and when training starts."""

import copy

import pytest
import torch

from diffsynth_core.errors import InputError
from diffsynth_core.training.loop import Trainer
from diffsynth_core.training.metrics import read_metrics
from stages.config import ConfigError, OffloadSection, TrainSection, build_config

from .toy import TOY_SPEC, ToyDiT, lora_of, toy_samples

PLAIN = dict(lora_rank=4, max_steps=6, save_steps=2, learning_rate=1e-2, seed=5, gradient_checkpointing=False,
             max_grad_norm=None)


def _fit(out, model, samples, in_backward: bool, **options):
    # the reference steps after backward with the same fused kernel (the key builds AdamW fused)
    train = TrainSection(**{**PLAIN, **options}, **({} if in_backward else {"optimizer_args": {"fused": True}}))
    offload = OffloadSection(optimizer_step_in_backward=in_backward)
    return Trainer(TOY_SPEC, model, samples, train, offload, out, progress=False).fit()


def test_steps_in_backward_train_and_resume_bitwise_like_the_step_after_backward(tmp_path):
    torch.manual_seed(0)
    base = ToyDiT()
    after = _fit(tmp_path / "after", copy.deepcopy(base), toy_samples(), in_backward=False)
    during = _fit(tmp_path / "during", copy.deepcopy(base), toy_samples(), in_backward=True)
    assert during.steps_in_backward.stats["pages_stepped"] == 6 * len(during.steps_in_backward.pages)
    assert during.losses == after.losses
    expected = lora_of(after.model)
    assert all(torch.equal(expected[k], v) for k, v in lora_of(during.model).items())
    _fit(tmp_path / "resumed", copy.deepcopy(base), toy_samples(), in_backward=True, max_steps=3)
    resumed = _fit(tmp_path / "resumed", copy.deepcopy(base), toy_samples(), in_backward=True)
    assert resumed.resumed_from == 3 and resumed.losses == after.losses[3:]
    assert all(torch.equal(expected[k], v) for k, v in lora_of(resumed.model).items())


def test_a_nan_sample_moves_no_weight_as_the_skipped_step_after_backward(tmp_path):
    torch.manual_seed(0)
    base = ToyDiT()
    samples = toy_samples(6)
    samples[2] = {**samples[2], "latents": torch.full_like(samples[2]["latents"], float("nan"))}
    runs = [_fit(tmp_path / str(flag), copy.deepcopy(base), samples, in_backward=flag) for flag in (False, True)]
    losses = [row["loss"] for row in read_metrics(tmp_path / "True" / "metrics.csv")]
    assert losses.count("nan") == 1
    expected = lora_of(runs[0].model)
    got = lora_of(runs[1].model)
    assert all(torch.isfinite(v).all() and torch.equal(expected[k], v) for k, v in got.items())


def test_non_finite_steps_in_a_row_stop_the_run(tmp_path):
    samples = [{**s, "latents": torch.full_like(s["latents"], float("inf"))} for s in toy_samples(6)]
    with pytest.raises(InputError, match=r"training stopped at step 2: loss nan, 2 step\(s\) in a row"):
        _fit(tmp_path, ToyDiT(), samples, in_backward=True, max_nonfinite_steps=2)


@pytest.mark.parametrize("setting, message", [
    ({"max_grad_norm": 1.0}, r"before the gradient norm to clip by is known: set train.max_grad_norm = 0"),
    ({"gradient_accumulation_steps": 2}, r"train.gradient_accumulation_steps must be 1 \(got 2\)"),
    ({"optimizer": "torch.optim.RMSprop"}, r"needs train.optimizer = torch.optim.AdamW, Adam or SGD"),
    ({"optimizer_args": {"fused": False}}, r"needs a fused optimizer .*remove train.optimizer_args.fused"),
], ids=["clipping", "accumulation", "optimizer", "not-fused"])
def test_what_cannot_step_in_backward_is_refused_when_training_starts(tmp_path, setting, message):
    train = TrainSection(**{**PLAIN, **setting})
    trainer = Trainer(TOY_SPEC, ToyDiT(), toy_samples(), train, OffloadSection(optimizer_step_in_backward=True),
                      tmp_path, progress=False)
    with pytest.raises(InputError, match=message):
        trainer.fit()


@pytest.mark.parametrize("overrides, message", [
    ([], r"train.max_grad_norm = 0 \(no clipping\)"),  # the default clips
    (["train.max_grad_norm=0", "offload.enable_model_cpu_offload=true", "offload.enable_optimizer_cpu_offload=true"],
     r"both place the optimizer step"),
])
def test_the_config_refuses_it_before_anything_runs(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_config({}, ["offload.optimizer_step_in_backward=true", *overrides])
    assert "\n" not in str(err.value)
