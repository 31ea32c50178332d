"""Host memory: one arena sized from the model, 64-byte aligned, pageable fallback with one warning;
never two copies of the model in host RAM, attach to detach."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from diffsynth_core.offload import OffloadTrainingManager, arena
from offload_tiny import ToyStack


def test_arena_is_sized_from_the_model_and_64_byte_aligned():
    model = ToyStack(d=96, n=4).requires_grad_(False)
    weight_bytes = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    mgr = OffloadTrainingManager(model, "cpu")
    rep = mgr.report()
    assert weight_bytes <= rep["arena_bytes"] <= 1.05 * weight_bytes
    assert rep["streamed_bytes"] == rep["arena_bytes"]
    base = mgr.arena.buffer.data_ptr()
    for block in model.blocks:  # evicted weights are views into the one arena
        for p in block.parameters():
            assert p.data_ptr() % 64 == 0
            assert base <= p.data_ptr() < base + rep["arena_bytes"]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    mgr.detach()
    for name, p in model.named_parameters():  # detach hands the arena's memory over: no copy
        assert torch.equal(p, before[name]) and p.device.type == "cpu"
        if name.startswith("blocks."):
            assert base <= p.data_ptr() < base + rep["arena_bytes"], name


def test_pinning_unavailable_falls_back_to_pageable_with_one_warning(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("exercises the no-CUDA path")
    monkeypatch.setattr(arena, "_warned_pageable", False)
    with pytest.warns(RuntimeWarning, match="pageable") as record:
        mgrs = [OffloadTrainingManager(ToyStack().requires_grad_(False), "cpu", pin_memory=True) for _ in range(2)]
    assert len([w for w in record if "pageable" in str(w.message)]) == 1
    assert not any(m.report()["pinned"] for m in mgrs)
    with torch.no_grad():
        mgrs[0].model(torch.randn(2, 16))
    for m in mgrs:
        m.detach()


def test_cpu_target_defaults_to_pageable_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = OffloadTrainingManager(ToyStack().requires_grad_(False), "cpu")
    assert not mgr.report()["pinned"]
    mgr.detach()


_RSS_SCRIPT = r"""
import sys, torch
sys.path[:0] = [{root!r}, {here!r}]
from diffsynth_core.offload import OffloadTrainingManager
from offload_tiny import ToyStack, add_lora

def status(key):  # bytes, from /proc/self/status (VmRSS: now; VmHWM: high-water mark)
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

torch.manual_seed(0)
model = add_lora(ToyStack(d=1024, n=12), ["up", "down"])
size = sum(p.numel() * 4 for p in model.blocks.parameters() if not p.requires_grad)
x = torch.randn(1, 1024)
base = max(status("VmRSS"), status("VmHWM"))
mgr = OffloadTrainingManager(model, "cpu")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
for _ in range(2):
    model(x).pow(2).mean().backward(); mgr.after_backward(); opt.step(); opt.zero_grad()
slots = sum(s.buf.numel() for s in mgr.streamer.slots)  # a CPU target's "device" slots are host RAM too
mgr.detach()  # in place
peak = status("VmHWM")
mgr = OffloadTrainingManager(model, "cpu")
model(x).sum().backward(); mgr.after_backward()
mgr.detach(restore_frozen=False)  # the frozen base released
print(size, slots, base, peak, status("VmRSS"))
"""


def test_host_ram_never_holds_two_copies_and_release_frees_the_base():
    here = Path(__file__).parent
    script = _RSS_SCRIPT.format(root=str(here.parents[2]), here=str(here))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    size, slots, base, peak, now = map(int, out.split())
    assert size > 200e6
    # The original weights are dropped as the arena fills, and detach hands the arena's memory back
    # to the weights: from attach to detach the high-water mark stays near one copy of the model.
    assert peak - base - slots < 0.15 * size, (peak - base - slots) / size
    assert now < base - 0.5 * size, (base - now) / size  # restore_frozen=False: the base left host RAM
