"""The optimizer's state in host memory between steps (``HostOptimizerState``), on CUDA.

What must hold: the update is bitwise the one of state kept on the GPU, for torch's fused and
for-each AdamW and for SGD with momentum; between steps every non-scalar state tensor is in
pinned host memory, and the GPU peak of forward + backward falls by the state's bytes; a
checkpoint (``state_dict``) taken mid-run and loaded into a fresh optimizer resumes bitwise.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from diffsynth_core.offload.optimizer_state import HostOptimizerState
from offload_tiny import assert_same_runs, state_tensors

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
WIDTH, DEPTH = 512, 6


def _model(depth: int = DEPTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(depth)]).to(CUDA)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(256, WIDTH, generator=torch.Generator().manual_seed(step)).to(CUDA)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, fused=kind == "fused", foreach=kind == "foreach" or None)


def _step(model, optimizer, step: int) -> float:
    loss = model(_batch(step)).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("kind", ["fused", "foreach", "sgd"])
def test_state_on_host_steps_bitwise_like_state_on_the_gpu(kind):
    runs = []
    for on_host in (False, True):
        model = _model()
        optimizer = _optimizer(kind, model.parameters())
        keeper = HostOptimizerState(optimizer) if on_host else None
        losses = [_step(model, optimizer, s) for s in range(5)]
        if keeper is not None:
            keeper.wait()
            state = state_tensors(optimizer)
            assert state and all(t.device.type == "cpu" and t.is_pinned() for t in state)
            # after the first step every arena goes out and comes in as one copy a step
            assert keeper.stats["h2d_bytes"] == 4 * keeper.stats["host_bytes"]
            assert keeper.stats["host_bytes"] >= sum(t.nbytes for t in state)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert_same_runs(runs)


def _third_step_peak(attach=None, depth: int = DEPTH, with_the_step: bool = True) -> tuple[int, int, int]:
    """GPU peak of a third step's forward and backward (and optimizer step, ``with_the_step``), with
    the optimizer ``attach`` -ed to; and the optimizer state's and the weights' bytes."""
    model = _model(depth)
    optimizer = _optimizer("fused", model.parameters())
    if attach is not None:
        attach(optimizer)
    for s in range(2):
        _step(model, optimizer, s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if with_the_step:
        _step(model, optimizer, 9)
    else:
        model(_batch(9)).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(), sum(t.nbytes for t in state_tensors(optimizer)),
            sum(p.nbytes for p in model.parameters()))


def test_state_on_host_lowers_the_forward_and_backward_peak_by_its_bytes():
    plain, _, _ = _third_step_peak(with_the_step=False)
    on_host, state_bytes, _ = _third_step_peak(HostOptimizerState, with_the_step=False)
    assert plain - on_host >= 0.95 * state_bytes  # the moments are two weights' worth of fp32


def _page_in_backward(optimizer):
    from diffsynth_core.offload.backward_steps import StepInBackward

    return StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4)


@pytest.mark.parametrize("attach", [HostOptimizerState, _page_in_backward], ids=["state-on-host", "steps-in-backward"])
def test_a_checkpoint_taken_with_the_state_off_the_gpu_resumes_bitwise(attach):
    model = _model()
    optimizer = _optimizer("fused", model.parameters())
    attach(optimizer)
    for s in range(3):
        _step(model, optimizer, s)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    expected = [_step(model, optimizer, 3)]
    torch.cuda.synchronize()
    step_peak = torch.cuda.max_memory_allocated()
    expected += [_step(model, optimizer, s) for s in range(4, 6)]
    state_bytes, weight_bytes = sum(t.nbytes for t in state_tensors(optimizer)), sum(p.nbytes for p in model.parameters())

    resumed = _model()
    saved.seek(0)
    ckpt = torch.load(saved, weights_only=True, map_location="cpu")  # as the Trainer loads one
    resumed.load_state_dict(ckpt["model"])
    optimizer2 = _optimizer("fused", resumed.parameters())
    attach(optimizer2)
    optimizer2.load_state_dict(ckpt["optimizer"])  # torch puts it on the GPU; the hook sends it straight back
    assert all(t.device.type == "cpu" and t.is_pinned() for t in state_tensors(optimizer2))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    got = [_step(resumed, optimizer2, 3)]
    torch.cuda.synchronize()
    # the first step after a resume peaks like any other (StepInBackward lays its pages out in it),
    # beside the first run's weights (its state waits on the host)
    assert torch.cuda.max_memory_allocated() < step_peak + weight_bytes + state_bytes // 2
    got += [_step(resumed, optimizer2, s) for s in range(4, 6)]
    assert got == expected
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

def _fit_tiny_qwen(out, max_steps: int, train_keys: dict | None = None, offload_keys: dict | None = None):
    """A tiny diffusers Qwen-Image DiT through the real Trainer on CUDA (deterministic), blocks
    streamed by the engine, LoRA r4, a checkpoint every 2 steps; ``*_keys``: more config keys."""
    from diffsynth_core.models import get_family, qwen_image
    from diffsynth_core.models.random_models import build_random_transformer
    from diffsynth_core.training.device import avoid_broken_kernels
    from diffsynth_core.training.loop import Trainer
    from stages.config import OffloadSection, TrainSection

    device = avoid_broken_kernels("cuda")
    spec = get_family("qwen_image")
    cfg = {**qwen_image.TRANSFORMER_CONFIGS["tiny"], "num_layers": 2}
    model = build_random_transformer(qwen_image.TRANSFORMER_CLASS, {"w": cfg}, "w", torch.float32, torch.device("cpu"))
    samples = []
    for seed in range(2):
        latents, cond = spec.dummy_inputs(model.config, batch=1, height=64, width=64, text_len=16, seed=seed)
        samples.append({"latents": latents[0], **{k: v[0] for k, v in cond.items()}})
    train = TrainSection(lora_rank=4, max_steps=max_steps, save_steps=2, seed=0, gradient_checkpointing=True,
                         device="cuda", deterministic=True, **(train_keys or {}))
    offload = OffloadSection(enable_model_cpu_offload=True, **(offload_keys or {}))
    result = Trainer(spec, model, samples, train, offload, out, device=device, progress=False).fit()
    lora = {k: v.detach().cpu() for k, v in result.model.named_parameters() if "lora_" in k}
    return result, lora


@pytest.fixture
def deterministic_mode(monkeypatch):
    """train.deterministic sets process-wide flags: give the other tests of this process theirs back."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, torch.backends.cuda.cudnn_sdp_enabled())
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    torch.backends.cuda.enable_cudnn_sdp(before[3])


def test_the_trainer_with_state_on_host_trains_and_resumes_bitwise_like_without(tmp_path, deterministic_mode):
    pytest.importorskip("diffusers")
    hosted = {"optimizer_state_on_host": True}
    plain, plain_lora = _fit_tiny_qwen(tmp_path / "plain", 4)
    run, run_lora = _fit_tiny_qwen(tmp_path / "hosted", 4, offload_keys=hosted)
    assert run.host_state is not None and run.host_state.stats["steps"] == 4
    assert run.losses == plain.losses
    assert all(torch.equal(run_lora[k], plain_lora[k]) for k in plain_lora)
    _fit_tiny_qwen(tmp_path / "resumed", 2, offload_keys=hosted)  # stops after its checkpoint at step 2
    resumed, resumed_lora = _fit_tiny_qwen(tmp_path / "resumed", 4, offload_keys=hosted)
    assert resumed.resumed_from == 2
    assert all(torch.equal(resumed_lora[k], plain_lora[k]) for k in plain_lora)


def test_the_trainer_stepping_in_backward_trains_and_resumes_bitwise_like_the_step_after(tmp_path, deterministic_mode):
    """offload.optimizer_step_in_backward: no clipping (the key refuses it); the reference steps
    after backward with the same fused AdamW."""
    pytest.importorskip("diffusers")
    no_clip, paged = {"max_grad_norm": None}, {"optimizer_step_in_backward": True}
    plain, plain_lora = _fit_tiny_qwen(tmp_path / "plain", 4, {**no_clip, "optimizer_args": {"fused": True}})
    run, run_lora = _fit_tiny_qwen(tmp_path / "paged", 4, no_clip, paged)
    pager = run.steps_in_backward
    pager.wait()
    assert pager.stats["pages_stepped"] == 4 * len(pager.pages) and pager.stats["d2h_bytes"] > 0
    assert all(t.device.type == "cpu" and t.is_pinned() for t in state_tensors(pager.optimizer))
    assert run.losses == plain.losses
    assert all(torch.equal(run_lora[k], plain_lora[k]) for k in plain_lora)
    _fit_tiny_qwen(tmp_path / "resumed", 2, no_clip, paged)
    resumed, resumed_lora = _fit_tiny_qwen(tmp_path / "resumed", 4, no_clip, paged)
    assert resumed.resumed_from == 2
    assert all(torch.equal(resumed_lora[k], plain_lora[k]) for k in plain_lora)


# --- StepInBackward: each page of weights steps during backward, its state paged in from the host ---

@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_steps_in_backward_are_bitwise_the_step_after_backward(kind):
    from diffsynth_core.offload.backward_steps import StepInBackward

    runs = []
    for in_backward in (False, True):
        model = _model()
        optimizer = _optimizer(kind, model.parameters())
        pager = StepInBackward(optimizer, page_bytes=WIDTH * WIDTH * 4) if in_backward else None  # ~a Linear a page
        losses = [_step(model, optimizer, s) for s in range(5)]
        if pager is not None:
            pager.wait()
            assert len(pager.pages) >= DEPTH - 1 and pager.stats["pages_stepped"] == 5 * len(pager.pages)
            assert all(t.device.type == "cpu" and t.is_pinned() for t in state_tensors(optimizer))
            assert pager.stats["h2d_bytes"] > 0 and pager.stats["late_copies_in"] <= 4  # the first page of each step
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert_same_runs(runs)


def test_steps_in_backward_keep_state_and_gradients_off_the_backward_peak():
    plain, _, weights = _third_step_peak(depth=24)
    paged, _, _ = _third_step_peak(_page_in_backward, depth=24)
    # plain: both moments (2x the weights) and, at the step, every gradient (1x); paged: the state and
    # gradients of the few pages in flight (about 3 of 24 weights' worth)
    assert plain - paged >= 2 * weights


def test_a_second_backward_before_the_step_is_refused():
    from diffsynth_core.offload.backward_steps import StepInBackward

    model = _model()
    optimizer = _optimizer("fused", model.parameters())
    StepInBackward(optimizer)
    model(_batch(0)).float().pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        model(_batch(1)).float().pow(2).mean().backward()


@pytest.mark.parametrize("watched", [True, False], ids=["watched", "unwatched"])
def test_a_budget_leaves_room_for_the_step_when_the_state_comes_back_for_it(watched):
    """LoRA r512 on a streamed stack of 134 MB blocks: the adapters' AdamW state (1.2 GB, 2x the
    adapters) is far larger than the backward's activations, so with the state on the host the
    optimizer step is the peak.  ``watch_optimizer`` (as the Trainer registers it) lets the plan see
    it; without it the plan keeps every block and the step overruns the budget (by more than the
    planner's 256 MiB + 2 % margin)."""
    from diffsynth_core.gradient import apply_gradient_checkpointing
    from diffsynth_core.offload import OffloadTrainingManager
    from offload_tiny import ToyStack, add_lora

    def run(budget):
        torch.manual_seed(0)
        model = add_lora(ToyStack(d=4096, n=12).to(torch.bfloat16), ["up", "down"], rank=512)
        model.offset = model.offset.to(CUDA, torch.bfloat16)
        apply_gradient_checkpointing(model, ("blocks",))
        unit = sum(p.numel() * 2 for p in model.blocks[0].parameters() if not p.requires_grad)  # bf16 bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        mgr = OffloadTrainingManager(model, CUDA, vram_budget_gb=(budget or 0) / 2**30,
                                     trainable_dtype=torch.float32)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        if watched:
            mgr.watch_optimizer(opt)
        HostOptimizerState(opt)
        x = torch.randn(256, 4096, device=CUDA, dtype=torch.bfloat16)
        for _ in range(4):
            model(x).float().pow(2).mean().backward()
            mgr.after_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        resident = mgr.report()["budget_units"]
        mgr.detach()
        return torch.cuda.max_memory_allocated(), unit, resident

    streamed_peak, unit, _ = run(None)  # every block streamed; the peak includes the optimizer step
    budget = (streamed_peak + 4.5 * unit + 2**28) * 50 / 49  # room for four blocks (+ budget.margin_bytes)
    if watched:
        peak, _, resident = run(budget)
        assert resident >= 3 and peak <= budget
    else:  # the plan saw only forward and backward, and kept blocks the step then had no room for
        with pytest.warns(RuntimeWarning, match="over offload.vram_budget_gb"):
            peak, _, resident = run(budget)
        assert resident > 4 and peak > budget
