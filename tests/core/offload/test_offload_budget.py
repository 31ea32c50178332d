"""The byte plan under a GPU memory budget: which units stay resident, and failing early."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from diffsynth_core.errors import InputError
from diffsynth_core.offload import OffloadTrainingManager
from diffsynth_core.offload.budget import plan_residency, simulate_loads
from diffsynth_core.offload.units import TensorRecord, Unit
from offload_tiny import ToyStack, add_lora


def _units(sizes: list[tuple[int, int]]) -> list[Unit]:
    """Frozen units with (host bytes, device bytes) each; fewer host bytes: stored in fp8."""
    units = []
    for i, (host, dev) in enumerate(sizes):
        p = nn.Parameter(torch.empty(1), requires_grad=False)
        store = torch.float8_e4m3fn if host < dev else p.dtype
        unit = Unit(i, f"blocks.{i}", nn.Identity(), [TensorRecord(p, p.shape, p.dtype, p.device, store, p.dtype)])
        unit.host_bytes, unit.dev_bytes = host, dev
        units.append(unit)
    return units


def _step_uses(n: int) -> list[int]:
    """Forward in order, then backward in reverse (recompute uses fall on the loaded unit)."""
    return list(range(n)) + [u for i in reversed(range(n)) for u in (i, i)]


def test_units_that_save_most_copied_bytes_stay_spread_evenly():
    units = _units([(100, 100)] * 8)
    plan = plan_residency(units, _step_uses(8), n_slots=2, room=250)
    # Blocks 0, 1 and 6, 7 cost one copy a step (the slots keep them across the turns); of the
    # two-copy blocks 2..5, two fit, evenly spread (two spread over all eight, 2 and 6, copy as many
    # bytes and leave as many streamed blocks back to back: no reason to prefer them).
    assert [u.index for u in plan.resident] == [3, 5]
    assert plan.streamed_bytes == 100 * (8 * 2 - 4)
    loads = simulate_loads(_step_uses(8), [0, 1, 2, 4, 6, 7], 2, set(range(8)))
    assert plan.planned_bytes == 100 * sum(loads.values()) == plan.streamed_bytes - 2 * 2 * 100


def _back_to_back(resident: list[int], n: int) -> int:
    """Streamed blocks right after a streamed one in the forward (blocks in order 0..n-1)."""
    streamed = [i not in resident for i in range(n)]
    return sum(a and b for a, b in zip(streamed, streamed[1:]))


@pytest.mark.parametrize("n, kept", [(8, 3), (24, 12)])
def test_a_plan_spread_over_every_unit_wins_when_it_copies_no_more(n, kept):
    """Taken by bytes saved alone, the turn units (one copy a step) stay streamed and end up back to
    back with their neighbours (0, 1 and n-2, n-1), each copy hidden behind one unit's compute only.
    Spread evenly over all n, the same number kept copies as many bytes (other units are then kept
    across the turns) with fewer streamed units back to back: that plan is taken."""
    units = _units([(100, 100)] * n)
    plan = plan_residency(units, _step_uses(n), n_slots=2, room=kept * 100 + 50)
    by_value = {8: [2, 4, 5], 24: [2, 4, 6, 7, 9, 11, 12, 14, 16, 17, 19, 21]}[n]  # the plan before
    spread = {8: [1, 4, 6], 24: list(range(1, 24, 2))}[n]  # as musubi-tuner places its resident blocks
    assert [u.index for u in plan.resident] == spread
    loads = simulate_loads(_step_uses(n), [i for i in range(n) if i not in by_value], 2, set(range(n)))
    assert plan.planned_bytes == 100 * sum(loads.values())  # no more bytes than the plan by value alone
    assert _back_to_back(spread, n) < _back_to_back(by_value, n)


def test_fp8_stored_units_are_kept_as_stored_and_widened_only_when_all_fit():
    # fp8 storage: host bytes are half the device bytes.  Kept as stored ("compact") a unit saves
    # its copies for half the device bytes of a widened one, so twice as many fit.
    fp8 = _units([(50, 100)] * 8)
    plan = plan_residency(fp8, _step_uses(8), n_slots=2, room=200)
    assert plan.resident == [] and [u.index for u in plan.compact] == [2, 3, 4, 5]
    # Compact units still go through the slots (widened there) but copy nothing from the host.
    loads = simulate_loads(_step_uses(8), list(range(8)), 2, set(range(8)))
    assert plan.planned_bytes == 50 * sum(n for i, n in loads.items() if i not in (2, 3, 4, 5))
    # Room for every unit as stored and two more widenings' worth: two evenly spaced are widened.
    plan = plan_residency(fp8, _step_uses(8), n_slots=2, room=8 * 50 + 2 * 50)
    assert [u.index for u in plan.resident] == [2, 6] and len(plan.compact) == 6
    assert plan.planned_bytes == 0
    # Equal bytes saved per device byte: the unit that needs no widening wins.
    mixed = _units([(100, 100), (100, 100), (100, 100), (50, 100), (100, 100), (50, 100), (100, 100), (100, 100)])
    plan = plan_residency(mixed, _step_uses(8), n_slots=2, room=200)
    assert [u.index for u in plan.resident] == [2, 4] and plan.compact == []


def test_budget_that_cannot_hold_the_slots_fails_at_attach_naming_the_key():
    model = add_lora(ToyStack(d=64, n=4), ["up"])
    # a toy's needs are MiB: said in MiB, not as "0.00 GiB"
    with pytest.raises(InputError, match=r"offload.vram_budget_gb = 0.0 MiB cannot hold .* needs (?!0\.0 )[0-9.]+ MiB"):
        OffloadTrainingManager(model, "cpu", vram_budget_gb=1e-9)
    with pytest.raises(InputError, match="auto.*CUDA"):
        OffloadTrainingManager(model, "cpu", vram_budget_gb="auto")
    with pytest.raises(InputError, match="vram_budget_gb"):
        OffloadTrainingManager(model, "cpu", vram_budget_gb=-1)
    assert not hasattr(model, "_splitflow_offload_manager")  # nothing was attached


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_budget_over_blocks_stepped_on_the_host_says_it_keeps_none(lora):
    import warnings

    model = add_lora(ToyStack(d=64, n=4), ["up"]) if lora else ToyStack(d=64, n=4)
    with pytest.warns(RuntimeWarning, match="keeps none resident"):
        mgr = OffloadTrainingManager(model, "cpu", enable_optimizer_cpu_offload=True, vram_budget_gb=1.0)
    mgr.detach()
    with warnings.catch_warnings():  # frozen blocks can stay resident: nothing to say
        warnings.simplefilter("error")
        OffloadTrainingManager(model, "cpu", vram_budget_gb=1.0).detach()


def test_fp8_units_kept_as_stored_train_bitwise_like_streamed_ones_and_copy_less():
    from diffsynth_core.gradient import apply_gradient_checkpointing
    from offload_tiny import budget_for, train

    runs, copied = [], []
    for budget in (False, True):
        torch.manual_seed(0)
        model = add_lora(ToyStack(d=64, n=6), ["up", "down"])
        apply_gradient_checkpointing(model, ("blocks",))
        opts = dict(storage_dtype=torch.float8_e4m3fn, trainable_dtype=torch.float32)
        if budget:  # room for three blocks as stored (fp8 codes + scales), not for one widened block more
            stored = OffloadTrainingManager(model, "cpu", **opts)
            unit_host = stored.plan.units[0].host_bytes
            stored.detach()
            opts["vram_budget_gb"] = budget_for(model, 3.5 * unit_host, **opts)
        mgr = OffloadTrainingManager(model, "cpu", poison_evicted=True, **opts)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
        runs.append(train(model, 4, lambda s, m: model(x + s).pow(2).mean(), mgr))
        rep = mgr.report()
        if budget:
            assert rep["compact_units"] == 3 and rep["budget_units"] == 0
            assert rep["device_widenings"] > 0
            assert rep["staged_ahead"] > 0  # copies between the kept units start ahead of their slots
            assert rep["planned_h2d_bytes_per_step"] == rep["last_step_h2d_bytes"]
        copied.append(rep["last_step_h2d_bytes"])
        mgr.detach()
    assert copied[1] < copied[0]
    (la, ga), (lb, gb) = runs
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for sa, sb in zip(ga, gb) for a, b in zip(sa, sb))


class _ReadMemory:
    """What the tracker reads from ``torch.cuda`` (no GPU here): allocated and peak bytes as set."""

    cuda = True

    def __init__(self):
        self.now = self.top = 0

    def allocated(self):
        return self.now

    def peak(self):
        return self.top

    def reset_peak(self):
        self.top = self.now

    def step_to(self, high: int, then: int) -> None:
        self.top, self.now = max(self.top, high), then


@pytest.mark.parametrize("step_peak, left_after, overhead", [
    (7, 6, 10 + 4),  # the optimizer's 4 GiB of state stay on the device: the backward's peak + them
    (7, 2, 10),      # the state waits on the host between steps, and the backward's peak is higher
    (12, 2, 12),     # ... a larger state: its step, beside every gradient, is the peak
], ids=["state-stays", "state-leaves", "state-leaves-large"])
def test_the_plan_leaves_room_for_the_first_optimizer_step_too(step_peak, left_after, overhead):
    from diffsynth_core.offload.budget import GIB, BudgetTracker

    budget = 20 * GIB
    tracker = BudgetTracker(budget, torch.device("cpu"), fixed=GIB)  # margin 0: exact arithmetic
    tracker.memory = memory = _ReadMemory()
    memory.now = 2 * GIB
    tracker.begin_first_step()
    memory.step_to(10 * GIB, 3 * GIB)  # forward + backward peak at 10 GiB; gradients left after it
    tracker.end_step(first=True)
    memory.step_to(step_peak * GIB, left_after * GIB)  # the first optimizer.step()
    tracker.optimizer_stepped()
    memory.step_to(19 * GIB, left_after * GIB)  # between steps (a validation render): not the step's
    assert tracker.room() == budget - overhead * GIB


def test_a_budget_over_blocks_stepped_on_the_host_buys_slots_that_hold_them_across_the_turn():
    """Full fine-tuning with optimizer offload: no block can stay resident, so what the budget leaves
    (room for two blocks here) becomes two more slots; the ring then still holds the forward's last
    four blocks when backward starts, and those are copied once a step instead of twice.  Same
    training, bit for bit."""
    from offload_tiny import budget_for, train

    runs, reports = [], []
    for budget in (False, True):
        torch.manual_seed(0)
        model = ToyStack(d=64, n=6)
        opts = dict(enable_optimizer_cpu_offload=True)
        if budget:
            probe = OffloadTrainingManager(model, "cpu", **opts)
            slot = probe.streamer.slot_bytes
            probe.detach()
            opts["vram_budget_gb"] = budget_for(model, 2.5 * slot, **opts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the budget's "keeps none resident": tested above
            mgr = OffloadTrainingManager(model, "cpu", poison_evicted=True, **opts)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
        runs.append(train(model, 4, lambda s, m: model(x + s).pow(2).mean(), mgr, fused=True))
        reports.append(mgr.report())
        mgr.detach()
    plain, held = reports
    assert plain["slots"] == 2 and held["slots"] == 4 and held["budget_units"] == 0
    block = held["streamed_bytes"] // 6
    # two more blocks (of the forward's last four) find their weights still in a slot at the turn
    assert plain["last_step_h2d_bytes"] - held["last_step_h2d_bytes"] == 2 * block
    assert held["planned_h2d_bytes_per_step"] == held["last_step_h2d_bytes"]
    assert held["planned_peak_bytes"] <= held["budget_bytes"]
    (la, ga), (lb, gb) = runs
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for sa, sb in zip(ga, gb) for a, b in zip(sa, sb))


def test_the_plan_leaves_room_for_the_state_of_weights_the_first_step_did_not_train():
    """Two experts' LoRA, one optimizer: the first step routes to one expert, so its peak holds that
    expert's AdamW state only; the other's comes with its first step and stays (Wan2.2 A14B)."""
    from diffsynth_core.offload.budget import GIB, BudgetTracker, unstepped_state_bytes

    high, low = nn.Linear(16, 16, bias=False), nn.Linear(16, 48, bias=False)
    opt = torch.optim.AdamW([*high.parameters(), *low.parameters()])
    assert unstepped_state_bytes(opt, torch.device("cpu")) == 0  # nothing stepped: no ratio to go by
    high(torch.ones(1, 16)).sum().backward()
    opt.step()
    # AdamW keeps two fp32 moments a weight and a 4-byte step count a tensor: (2 * 1024 + 4) bytes of
    # state for the high-noise expert's 1024 weight bytes; the low-noise one has 3072 still to step.
    assert unstepped_state_bytes(opt, torch.device("cpu")) == 3072 * (2 * 1024 + 4) // 1024

    tracker = BudgetTracker(20 * GIB, torch.device("cpu"), fixed=GIB)
    tracker.memory = memory = _ReadMemory()
    memory.now = 2 * GIB
    tracker.begin_first_step()
    memory.step_to(10 * GIB, 2 * GIB)
    tracker.end_step(first=True)
    assert tracker.room(state_to_come=3 * GIB) == tracker.room() - 3 * GIB == 7 * GIB
