"""Optimizer offload (full fine-tuning): host weights, gradients leave as produced, accumulation."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diffsynth_core.offload import OffloadTrainingManager
from offload_tiny import ToyStack, add_lora, train


def _model():
    torch.manual_seed(0)
    return ToyStack()


def _data(step, micro):
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + micro))


def _train_step(model, mgr, opt, step: int) -> torch.Tensor:
    """One step on ``_data(step, 0)`` as a training loop runs it with the engine (``mgr``) or without."""
    loss = model(_data(step, 0)).pow(2).mean()
    loss.backward()
    if mgr is not None:
        mgr.after_backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _run(engine: bool, accumulate: int, **opts):
    model = _model()
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, poison_evicted=True,
                                 **opts) if engine else None
    losses, grads = train(model, 3, lambda s, m: model(_data(s, m)).pow(2).mean(), mgr,
                          accumulate=accumulate, fused=True)
    if mgr is not None:
        mgr.detach()
    return losses, grads, model.state_dict()


def test_full_finetune_with_optimizer_offload_is_bitwise_identical():
    for accumulate in (1, 2):
        ref, got = _run(False, accumulate), _run(True, accumulate)
        assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
        assert all(torch.equal(a, b) for ga, gb in zip(ref[1], got[1]) for a, b in zip(ga, gb))
        assert all(torch.equal(ref[2][k], got[2][k]) for k in ref[2] if k != "calls")


def test_accumulation_equals_one_step_on_the_summed_loss():
    model = _model()
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    xs = [_data(0, 0), _data(0, 1)]
    for x in xs:
        model(x).pow(2).mean().backward()
        mgr.after_backward()
    accumulated = [p.grad.clone() for p in model.parameters()]
    mgr.detach()
    big = _model()
    sum(big(x).pow(2).mean() for x in xs).backward()
    for a, b in zip(accumulated, (p.grad for p in big.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gradients_leave_as_they_are_produced_and_weights_live_on_the_host():
    model = _model()
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    block_params = [p for b in model.blocks for p in b.parameters()]
    assert {id(p) for p in mgr.plan.host_trainable} == {id(p) for p in block_params}
    seen = {}

    def when_embed_gets_its_gradient(grad):  # the embed runs first, so its backward comes last
        seen["device_grads"] = [p for p in block_params if p.grad is not None]
        seen["queued"] = len(mgr.grad_sink.pending)
    h = model.embed.weight.register_hook(when_embed_gets_its_gradient)
    model(_data(0, 0)).sum().backward()
    h.remove()
    assert seen["device_grads"] == [] and seen["queued"] == len(block_params)
    mgr.after_backward()
    base = mgr.arena.buffer.data_ptr()
    for p in block_params:
        assert p.grad is not None
        assert base <= p.data_ptr() < base + mgr.arena.nbytes  # the optimizer updates the host copy
    assert mgr.report()["d2h_grad_bytes"] == sum(p.numel() * 4 for p in block_params)
    mgr.detach()


def test_lora_parameters_are_upcast_to_fp32_on_a_bf16_base():
    from offload_tiny import add_lora
    torch.manual_seed(0)
    model = add_lora(ToyStack().to(torch.bfloat16), ["up", "down"])
    model.offset = model.offset.to(torch.bfloat16)  # a plain attribute: .to() does not convert it
    mgr = OffloadTrainingManager(model, "cpu", trainable_dtype=torch.float32)
    lora = [p for p in model.parameters() if p.requires_grad]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    assert all(p.dtype == torch.bfloat16 for p in model.blocks[0].up.base_layer.parameters())
    opt = torch.optim.AdamW(lora, lr=1e-3)
    out = model(torch.randn(2, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    out.float().pow(2).mean().backward()
    mgr.after_backward()
    opt.step()
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    mgr.detach()


def _scheduled_run(bind: bool | None, steps: int = 3):
    """AdamW with an lr that changes every step; ``bind``: None = no engine, else the engine with
    the optimizer bound (``overlap_backward=bind``)."""
    model = _model()
    mgr = None
    if bind is not None:
        mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, poison_evicted=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    if mgr is not None:
        mgr.bind_optimizer(opt, overlap_backward=bind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    losses = []
    for step in range(steps):
        loss = model(_data(step, 0)).pow(2).mean()
        loss.backward()
        if mgr is not None:
            mgr.after_backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    state = opt.state_dict()  # waits for the queued host steps
    if mgr is not None:
        mgr.detach()
    return losses, model.state_dict(), state


@pytest.mark.parametrize("overlap_backward", [False, True])
def test_bound_optimizer_steps_units_on_a_worker_and_is_bitwise_identical(overlap_backward):
    ref, got = _scheduled_run(None), _scheduled_run(overlap_backward)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert all(torch.equal(ref[1][k], got[1][k]) for k in ref[1] if k != "calls")
    for i, s in ref[2]["state"].items():  # one optimizer state, checkpointable as usual
        assert all(torch.equal(s[k], got[2]["state"][i][k]) for k in s)


def test_overlapped_steps_start_during_backward():
    model = _model()
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mgr.bind_optimizer(opt, overlap_backward=True)
    queued = {}

    def when_embed_gets_its_gradient(grad):  # the embed runs first, so its backward comes last
        queued["units"] = set(mgr.stepper._jobs)
    h = model.embed.weight.register_hook(when_embed_gets_its_gradient)
    model(_data(0, 0)).pow(2).mean().backward()
    h.remove()
    # Every block's step is already queued, except blocks[0]'s: it runs twice a forward, so its
    # gradient may come in two pieces (on CUDA), and its step waits for after_backward().
    assert queued["units"] == {u.index for u in mgr.plan.units} - {0}
    mgr.after_backward()
    opt.step()
    with pytest.raises(RuntimeError, match="accumulation"):
        for micro in range(2):  # overlap_backward steps after every backward: no accumulation
            model(_data(1, micro)).pow(2).mean().backward()
    mgr.detach()


@pytest.mark.parametrize("bind", [None, False, True])
def test_optimizer_step_before_after_backward_raises(bind):
    model = _model()
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if bind is not None:  # also when the host steps run on the worker, during backward or not
        mgr.bind_optimizer(opt, overlap_backward=bind)
    model(_data(0, 0)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="after_backward"):
        opt.step()
    mgr.after_backward()
    opt.step()  # in order: fine
    mgr.detach()


class _ThreadCountingAdamW(torch.optim.AdamW):
    """AdamW that records, per step, which thread ran it and with how many intra-op threads."""

    def step(self, closure=None):
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))
        return super().step(closure)


def test_host_steps_run_with_the_workers_own_thread_count():
    model = _model()
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    opt = _ThreadCountingAdamW(model.parameters(), lr=1e-2, fused=True)
    opt.seen = []
    main_threads = torch.get_num_threads()
    mgr.bind_optimizer(opt, overlap_backward=True, threads=1)
    for step in range(2):
        model(_data(step, 0)).pow(2).mean().backward()
        mgr.after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.state_dict()  # waits for the queued host steps
    worker = {n for name, n in opt.seen if name == "splitflow-host-optimizer"}
    assert worker == {1} and torch.get_num_threads() == main_threads  # the caller's count is untouched
    stats = mgr.report()["host_optimizer"]
    assert stats["threads"] == 1 and stats["jobs"] == 2 * len(mgr.stepper.subs) and stats["step_s"] > 0
    mgr.detach()
    other = OffloadTrainingManager(_model(), "cpu", enable_optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match="threads"):
        other.bind_optimizer(opt, threads=0)
    other.detach()


class _Copy:
    """A device->host gradient copy as the host optimizer sees its CUDA event (none on this CPU
    machine): ``query()`` says whether it ran, ``synchronize()`` waits for it."""

    def __init__(self):
        self.landed, self.awaited = threading.Event(), threading.Event()

    def query(self) -> bool:
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.awaited.set()
        self.landed.wait()


def test_worker_steps_units_whose_gradients_landed_before_earlier_units_still_copying():
    from diffsynth_core.offload.host_optimizer import HostStepper
    reals = {unit: torch.nn.Parameter(torch.zeros(4)) for unit in (0, 1, 5)}
    stepper = HostStepper(torch.optim.AdamW(reals.values(), lr=1e-2),
                          {unit: [(p, p.detach())] for unit, p in reals.items()}, threads=1)
    stepper.trace = []
    copies = {unit: _Copy() for unit in reals}
    for unit in (0, 1, 5):
        stepper.submit(unit, {id(reals[unit]): torch.ones(4)}, [copies[unit]])
        if unit == 0:
            copies[0].awaited.wait()  # the worker took unit 0 and waits for its copy
    copies[5].landed.set()  # unit 1 was queued first, but only unit 5's gradients are on the host
    copies[0].landed.set()
    deadline = time.monotonic() + 30
    while not stepper.is_done(5) and time.monotonic() < deadline:  # not stuck behind unit 1's copy
        time.sleep(0.01)
    stepped_5_first = stepper.is_done(5)
    copies[1].landed.set()
    stepper.close()
    assert stepped_5_first and [unit for what, unit, *_ in stepper.trace if what == "step"] == [0, 5, 1]
    assert all(not torch.equal(p, torch.zeros(4)) for p in reals.values())


class _FailingOnTheWorkerAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        if threading.current_thread().name == "splitflow-host-optimizer":
            raise ValueError("boom")
        return super().step(closure)


def test_a_failed_host_step_still_detaches_and_stops_the_worker():
    model = _model()
    mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True)
    opt = _FailingOnTheWorkerAdamW(model.parameters(), lr=1e-2)
    mgr.bind_optimizer(opt)
    model(_data(0, 0)).pow(2).mean().backward()
    mgr.after_backward()
    opt.step()  # queues the host steps, which fail on the worker
    with pytest.raises(RuntimeError, match="host optimizer step failed"):
        mgr.detach()
    assert not mgr.stepper._thread.is_alive()
    with pytest.raises(RuntimeError, match="was detached"):  # the teardown ran: nothing is left to retry
        mgr.detach()
    OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True).detach()  # the model is free again



def _lora_model():
    torch.manual_seed(0)
    return add_lora(ToyStack(), ["up", "down"])


def _adapters(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_lora_adapters_step_on_the_host_bitwise_like_plain_lora():
    """LoRA with optimizer offload: the adapters inside the blocks stream with them and their AdamW
    runs on the host (bound as the trainer binds it), bitwise as without the engine."""
    def run(engine: bool):
        model = _lora_model()
        mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True,
                                     poison_evicted=True) if engine else None
        adapters = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(adapters, lr=1e-2, fused=True)
        if mgr is not None:
            assert {id(p) for p in mgr.plan.host_trainable} == {id(p) for p in adapters}
            mgr.bind_optimizer(opt)
        losses = [_train_step(model, mgr, opt, step) for step in range(3)]
        opt.state_dict()  # waits for the queued host steps
        if mgr is not None:
            assert mgr.report()["host_optimizer"]["jobs"] > 0
            mgr.detach()
        return losses, _adapters(model)

    (ref_losses, ref), (losses, got) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    initial = _adapters(_lora_model())
    assert any(not torch.equal(initial[k], ref[k]) for k in ref)  # the adapters did train


def _device_share_run(share: float | None, steps: int = 4, resume_at: int | None = None,
                      reload_at: int | None = None, each_step=None, keep_state: bool = False):
    """AdamW with a changing lr, the optimizer bound with ``device_step_share=share`` (None: no
    engine); ``resume_at``: stop there, rebuild model, engine and optimizer from their state dicts;
    ``reload_at``: there, load the optimizer's state back into the running engine, its moments
    halved (new tensors, other values); ``each_step(model, mgr, opt, step)``: called after each step."""
    def build(model_state=None, opt_state=None):
        model = _model()
        if model_state is not None:
            model.load_state_dict(model_state)
        mgr = None
        if share is not None:
            mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, poison_evicted=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        if mgr is not None:
            mgr.bind_optimizer(opt, overlap_backward=True, device_step_share=share, keep_device_state=keep_state)
        return model, mgr, opt
    model, mgr, opt = build()
    losses, stats = [], []
    for step in range(steps):
        if step == resume_at:
            opt_state = opt.state_dict()  # waits for every step, host or device
            if mgr is not None:
                stats.append(mgr.report()["device_steps"])
                mgr.detach()
            model, mgr, opt = build(model.state_dict(), opt_state)
        if step == reload_at:
            saved = opt.state_dict()
            opt.load_state_dict({**saved, "state": {i: {k: v / 2 if k.startswith("exp_avg") else v.clone()
                                                        for k, v in s.items()} for i, s in saved["state"].items()}})
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (step + 1)
        losses.append(_train_step(model, mgr, opt, step))
        if each_step is not None:
            each_step(model, mgr, opt, step)
    state = opt.state_dict()
    if mgr is not None:
        stats.append(mgr.report()["device_steps"])
        mgr.detach()
    return losses, model.state_dict(), state, stats


def _assert_same_training(ref, got) -> None:
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    assert all(torch.equal(ref[1][k], got[1][k]) for k in ref[1] if k != "calls")
    for i, s in ref[2]["state"].items():  # one optimizer, its state checkpointable as usual
        assert s.keys() == got[2]["state"][i].keys() and all(torch.equal(s[k], got[2]["state"][i][k]) for k in s)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_steps_on_the_device_during_backward_are_bitwise_those_of_the_host(share):
    ref = _device_share_run(None)
    for got in (_device_share_run(share), _device_share_run(share, resume_at=2)):
        _assert_same_training(ref, got)
    _assert_same_training(_device_share_run(None, reload_at=2), _device_share_run(share, reload_at=2))
    stats = _device_share_run(share)[3][0]
    # the first units in forward order; blocks[0] runs twice a forward, so the worker steps it
    assert stats["units"] == (2 if share < 1 else 5)
    assert stats["units_stepped"] == 4 * (stats["units"] - 1) and stats["late_state_in"] == 0


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_device_steps_keeping_their_state_are_bitwise_those_of_the_host(share):
    """``keep_device_state``: no page is laid out or copied, resume and reload still train alike
    (a CPU run: the "device" is the host, so the state moves nowhere; the GPU test moves it)."""
    ref = _device_share_run(None)
    for got in (_device_share_run(share, keep_state=True), _device_share_run(share, resume_at=2, keep_state=True)):
        _assert_same_training(ref, got)
    _assert_same_training(_device_share_run(None, reload_at=2), _device_share_run(share, reload_at=2, keep_state=True))
    pages = []
    run = _device_share_run(share, keep_state=True, each_step=lambda m, mgr, o, s: pages.append(len(mgr.device_steps.pages)))
    stats = run[3][0]
    assert stats["units"] == (2 if share < 1 else 5) and stats["units_stepped"] == 4 * (stats["units"] - 1)
    assert pages == [0] * 4 and stats["h2d_bytes"] == 0  # no page, nothing paged in
    weights = sum(p.nbytes for p in _model().blocks[1:stats["units"]].parameters())
    assert stats["d2h_bytes"] == 4 * weights  # the new weights out, nothing else


def test_keep_device_state_needs_device_steps():
    mgr = OffloadTrainingManager(_model(), "cpu", enable_optimizer_cpu_offload=True)
    opt = torch.optim.AdamW(mgr.model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="keep_device_state"):
        mgr.bind_optimizer(opt, overlap_backward=True, keep_device_state=True)
    mgr.detach()


def _run_block_1_again(model) -> None:
    """From now on blocks[1] runs twice a forward as well (again just before the head)."""
    head, block = model.head.forward, model.blocks[1]
    model.head.forward = lambda x: head(block(x))


def test_device_units_keep_one_page_and_a_unit_run_twice_is_never_paged_in():
    """A device unit's state is laid out in a page at its first step only (not again each time it
    comes in, nor on a ``load_state_dict`` of the same shapes, whose values it takes), and between
    steps ``optimizer.state`` holds the page's host homes.  blocks[0] runs twice a forward: the
    worker steps it, so its state never comes in and stays the host tensors the worker made.
    blocks[1] runs twice from the third step on: it came in, and goes back untouched to the worker."""
    pages, twice = {}, []

    def reference(model, mgr, opt, step):
        if step == 1:
            _run_block_1_again(model)

    def check(model, mgr, opt, step):
        reference(model, mgr, opt, step)
        mgr.sync()
        steps = mgr.device_steps
        if step == 0:
            pages.update(steps.pages)
        if step in (0, 2):  # blocks[0]'s state: made by the worker, or by the reload before step 2
            twice[:] = [(p, k, v) for p in model.blocks[0].parameters() for k, v in opt.state[p].items()]
        assert all(opt.state[p][k] is v for p, k, v in twice)
        assert steps.pages.keys() == pages.keys() and all(steps.pages[u] is page for u, page in pages.items())
        for page in pages.values():
            assert page.on_device is None and all(opt.state[p][k] is home for p, k, _, home in page.layout)
        assert steps.stats["h2d_bytes"] == step * sum(page.arena.nbytes for page in pages.values())

    got = _device_share_run(1.0, reload_at=2, each_step=check)
    _assert_same_training(_device_share_run(None, reload_at=2, each_step=reference), got)
    assert sorted(pages) == [1, 2, 3, 4] and len(twice) == 6 * 3  # blocks[0] has no page: never paged in
    assert got[3][0]["units_stepped"] == 4 + 4 + 3 + 3 and got[3][0]["late_state_in"] == 0


def test_device_steps_need_overlap_backward_and_a_share_within_0_and_1():
    mgr = OffloadTrainingManager(_model(), "cpu", enable_optimizer_cpu_offload=True)
    opt = torch.optim.AdamW(mgr.model.parameters(), lr=1e-2)
    for kwargs in ({"device_step_share": 0.5}, {"device_step_share": 1.5, "overlap_backward": True}):
        with pytest.raises(ValueError, match="device_step_share"):
            mgr.bind_optimizer(opt, **kwargs)
    mgr.detach()
