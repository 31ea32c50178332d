"""Host memory: one arena sized from the model, 64-byte aligned, pageable fallback with one warning."""

from __future__ import annotations

import warnings

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
    mgr.detach()
    for block in model.blocks:  # detach gives each weight its own storage back
        for p in block.parameters():
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size()


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
