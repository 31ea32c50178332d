import copy

import pytest
import torch

from diffsynth_core.training.loop import Trainer
from diffsynth_core.training.metrics import read_metrics
from stages.config import OffloadSection, TrainSection

from .toy import TOY_SPEC, ToyDiT, toy_samples


def _train(tmp_path, model, **options):
    defaults = dict(lora_rank=4, max_steps=6, save_steps=2, learning_rate=1e-2, seed=5, gradient_checkpointing=False)
    train = TrainSection(**{**defaults, **options})
    trainer = Trainer(TOY_SPEC, model, toy_samples(), train, OffloadSection(), tmp_path, progress=False)
    return trainer.fit()


def _lora_weights(model):
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


def test_stop_and_resume_is_bit_for_bit_equal_to_an_uninterrupted_run(tmp_path):
    torch.manual_seed(0)
    base = ToyDiT()
    straight = _train(tmp_path / "straight", copy.deepcopy(base), max_steps=6)

    _train(tmp_path / "resumed", copy.deepcopy(base), max_steps=3)  # "killed" after step 3's checkpoint
    resumed = _train(tmp_path / "resumed", copy.deepcopy(base), max_steps=6)

    assert resumed.resumed_from == 3
    expected, got = _lora_weights(straight.model), _lora_weights(resumed.model)
    assert expected.keys() == got.keys() and expected
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    steps = [int(row["step"]) for row in read_metrics(tmp_path / "resumed" / "metrics.csv")]
    assert steps == [1, 2, 3, 4, 5, 6]
    losses = [row["loss"] for row in read_metrics(tmp_path / "resumed" / "metrics.csv")]
    assert losses == [row["loss"] for row in read_metrics(tmp_path / "straight" / "metrics.csv")]


def test_lora_trains_in_fp32_over_a_bf16_base_and_changes_the_output(tmp_path):
    torch.manual_seed(0)
    model = ToyDiT().to(torch.bfloat16)
    result = _train(tmp_path, model, max_steps=3, lora_init="default")
    lora = _lora_weights(result.model)
    assert all(v.dtype == torch.float32 for v in lora.values())
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # B starts at zero, so it trained
    assert result.model.inp.weight.dtype == torch.bfloat16 and not result.model.inp.weight.requires_grad


def test_each_optimizer_step_consumes_accumulation_samples_and_logs_one_row(tmp_path):
    torch.manual_seed(0)
    result = _train(tmp_path, ToyDiT(), max_steps=2, save_steps=0, gradient_accumulation_steps=3)
    state = torch.load(tmp_path / "checkpoints" / "step-00000002" / "state.pt", weights_only=True)
    assert (state["epoch"], state["position"]) == (0, 6)  # 2 steps x 3 samples = the whole epoch of 6
    assert len(result.losses) == 2
    assert [int(r["step"]) for r in read_metrics(tmp_path / "metrics.csv")] == [1, 2]


def test_checkpoints_keep_the_last_k_and_latest_points_to_the_newest(tmp_path):
    torch.manual_seed(0)
    _train(tmp_path, ToyDiT(), max_steps=8, save_steps=2, keep_checkpoints=2)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert kept == ["step-00000006", "step-00000008"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000008"


def test_unmatched_lora_target_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="nonexistent"):
        _train(tmp_path, ToyDiT(), lora_target_modules=["nonexistent"])


def test_tensorboard_events_are_written_when_asked(tmp_path):
    torch.manual_seed(0)
    _train(tmp_path, ToyDiT(), max_steps=2, tensorboard=True)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_preset_lora_is_fused_into_the_base_weights(tmp_path):
    from safetensors.torch import save_file

    from diffsynth_core.training.lora import fuse_lora_file

    torch.manual_seed(0)
    model = ToyDiT()
    before = model.transformer_blocks[0].proj.weight.detach().clone()
    down, up = torch.randn(2, 16), torch.randn(16, 2)
    save_file({"transformer.transformer_blocks.0.proj.lora_A.weight": down,
               "transformer.transformer_blocks.0.proj.lora_B.weight": up,
               "transformer.transformer_blocks.0.proj.alpha": torch.tensor(4.0)}, str(tmp_path / "preset.safetensors"))
    assert fuse_lora_file(model, tmp_path / "preset.safetensors") == 1
    expected = before + (up @ down) * (4.0 / 2)
    torch.testing.assert_close(model.transformer_blocks[0].proj.weight, expected)

    save_file({"transformer.nope.lora_A.weight": down, "transformer.nope.lora_B.weight": up},
              str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="nope"):
        fuse_lora_file(model, tmp_path / "bad.safetensors")


def test_ema_follows_its_recursion_over_the_trained_weights(tmp_path):
    from diffsynth_core.training.ema import EmaWeights, swapped_weights
    from diffsynth_core.training.prepare import prepare_for_training

    torch.manual_seed(0)
    base = ToyDiT()
    train = TrainSection(lora_rank=2, max_steps=3, save_steps=0, ema_decay=0.75, learning_rate=1e-2, seed=4,
                         gradient_checkpointing=False)
    start = prepare_for_training(copy.deepcopy(base), TOY_SPEC, train, OffloadSection(), torch.device("cpu"))
    expected = {name: p.detach().clone() for name, p in start.trainable.items()}  # the average starts here

    def average(step, model):  # ema = 0.75 ema + 0.25 w after every optimizer step
        for name, param in model.named_parameters():
            if name in expected:
                expected[name] = 0.75 * expected[name] + 0.25 * param.detach()

    result = Trainer(TOY_SPEC, copy.deepcopy(base), toy_samples(), train, OffloadSection(), tmp_path,
                     progress=False, callbacks=[average]).fit()
    assert result.ema.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(result.ema[name], expected[name], rtol=1e-6, atol=1e-7)
    raw = _lora_weights(result.model)
    assert any(not torch.equal(raw[n], result.ema[n]) for n in raw)
    with swapped_weights(result.model, result.ema):
        assert all(torch.equal(v, result.ema[k]) for k, v in _lora_weights(result.model).items())
    assert all(torch.equal(v, raw[k]) for k, v in _lora_weights(result.model).items())  # restored after
    with pytest.raises(ValueError, match="decay"):
        EmaWeights(raw, 1.0)


def test_epoch_end_callbacks_see_every_host_optimizer_step_done(tmp_path, monkeypatch):
    """With the host optimizer bound, optimizer.step() only queues the host steps: the epoch-end
    and checkpoint hooks (which export weights) run after the trainer waited for them."""
    import time

    from diffsynth_core.offload.host_optimizer import HostStepper

    step_host = HostStepper._step

    def slow_step(self, job):  # host steps still running when the loop moves on
        time.sleep(0.05)
        step_host(self, job)
    monkeypatch.setattr(HostStepper, "_step", slow_step)

    seen = []

    class Watcher:
        def __call__(self, step, model):
            pass

        def _record(self, model):
            stepper = model._splitflow_offload_manager.stepper
            seen.append(all(stepper.is_done(unit) for unit in stepper.subs))

        def on_epoch_end(self, epoch, step, model, lora_config):
            self._record(model)

        def on_checkpoint(self, step, model, lora_config):
            self._record(model)

    offload = OffloadSection(enable_model_cpu_offload=True, enable_optimizer_cpu_offload=True)
    train = TrainSection(lora_rank=0, trainable_models=["transformer"], max_steps=8, save_steps=0,
                         learning_rate=1e-2, seed=5, gradient_checkpointing=False)
    result = Trainer(TOY_SPEC, ToyDiT(), toy_samples(), train, offload, tmp_path, progress=False,
                     callbacks=[Watcher()]).fit()
    result.offload.detach()
    assert seen == [True, True]  # the epoch end at step 6, the checkpoint at step 8
