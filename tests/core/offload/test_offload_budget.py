"""The byte plan under a GPU memory budget: which units stay resident, and failing early."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffsynth_core.errors import InputError
from diffsynth_core.offload import OffloadTrainingManager
from diffsynth_core.offload.budget import plan_residency, simulate_loads
from diffsynth_core.offload.units import TensorRecord, Unit
from offload_tiny import ToyStack, add_lora


def _units(sizes: list[tuple[int, int]]) -> list[Unit]:
    """Frozen units with (host bytes, device bytes) each."""
    units = []
    for i, (host, dev) in enumerate(sizes):
        p = nn.Parameter(torch.empty(1), requires_grad=False)
        unit = Unit(i, f"blocks.{i}", nn.Identity(), [TensorRecord(p, p.shape, p.dtype, p.device, p.dtype, p.dtype)])
        unit.host_bytes, unit.dev_bytes = host, dev
        units.append(unit)
    return units


def _step_uses(n: int) -> list[int]:
    """Forward in order, then backward in reverse (recompute uses fall on the loaded unit)."""
    return list(range(n)) + [u for i in reversed(range(n)) for u in (i, i)]


def test_units_that_save_most_copied_bytes_stay_spread_evenly():
    units = _units([(100, 100)] * 8)
    plan = plan_residency(units, _step_uses(8), n_slots=2, room=350)
    # Blocks 0, 1 and 6, 7 cost one copy a step (the slots keep them across the turns); of the
    # two-copy blocks 2..5, three fit, evenly spread.
    assert [u.index for u in plan.resident] == [2, 4, 5]
    assert plan.streamed_bytes == 100 * (8 * 2 - 4)
    streamed = [0, 1, 3, 6, 7]
    loads = simulate_loads(_step_uses(8), streamed, 2, set(range(8)))
    assert plan.planned_bytes == 100 * sum(loads.values()) == plan.streamed_bytes - 3 * 2 * 100


def test_fp8_stored_units_save_half_as_many_bytes_per_device_byte():
    # Units 2..5 alternate bf16 storage (host = device bytes) and fp8 storage (host = half): keeping
    # an fp8 unit resident costs as much device memory but saves half the copied bytes.
    units = _units([(100, 100), (100, 100), (100, 100), (50, 100), (100, 100), (50, 100), (100, 100), (100, 100)])
    plan = plan_residency(units, _step_uses(8), n_slots=2, room=200)
    assert [u.index for u in plan.resident] == [2, 4]


def test_budget_that_cannot_hold_the_slots_fails_at_attach_naming_the_key():
    model = add_lora(ToyStack(d=64, n=4), ["up"])
    with pytest.raises(InputError, match=r"offload.vram_budget_gb = 0.00 GiB cannot hold"):
        OffloadTrainingManager(model, "cpu", vram_budget_gb=1e-9)
    with pytest.raises(InputError, match="auto.*CUDA"):
        OffloadTrainingManager(model, "cpu", vram_budget_gb="auto")
    with pytest.raises(InputError, match="vram_budget_gb"):
        OffloadTrainingManager(model, "cpu", vram_budget_gb=-1)
    assert not hasattr(model, "_splitflow_offload_manager")  # nothing was attached
