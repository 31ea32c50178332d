"""Copies staged ahead of their slots (``Streamer.stage_ahead``), on the CPU target: which copy a
load uses, which one is given up when the staging buffer is needed for another unit, and that every
copy is counted once, with the widened weights right whichever path they took."""
import torch

from diffsynth_core.offload import OffloadTrainingManager
from offload_tiny import ToyStack


def _streamer_with_widened_reference():
    torch.manual_seed(0)
    model = ToyStack(d=32, n=4).requires_grad_(False)  # frozen: stored as fp8
    mgr = OffloadTrainingManager(model, "cpu", storage_dtype=torch.float8_e4m3fn)
    streamer, units = mgr.streamer, [u for u in mgr.plan.streamed if u.casts]
    expected = {}
    for unit in units:  # each unit through the plain path: copy into the stage, widen into its slot
        streamer.load(unit, streamer.home_slot(unit))
        expected[unit.index] = [r.param.detach().clone() for r in unit.tensors]
    streamer.evict_all()
    return mgr, streamer, units, expected


def _check(unit, expected):
    assert all(torch.equal(r.param, e) for r, e in zip(unit.tensors, expected[unit.index]))


def test_a_staged_copy_is_used_once_and_given_up_when_its_buffer_is_needed():
    mgr, streamer, (a, b, c, *_), expected = _streamer_with_widened_reference()
    assert len(streamer.stages) == 1  # one staging buffer on a CPU target
    copies, bytes_ = streamer.copies, streamer.bytes

    assert streamer.stage_ahead(a) and streamer.staged_ahead == 1
    assert not streamer.stage_ahead(a) and not streamer.stage_ahead(b)  # already staged; buffer full
    streamer.load(a, streamer.home_slot(a))  # widened from the staged copy: no second copy
    _check(a, expected)
    assert a.index not in streamer.staged
    assert (streamer.copies, streamer.bytes) == (copies + 1, bytes_ + a.host_bytes)
    assert not streamer.stage_ahead(a)  # loaded already

    assert streamer.stage_ahead(b)
    streamer.load(c, streamer.home_slot(c))  # c needs the buffer b's copy holds: b's copy is given up
    _check(c, expected)
    assert streamer.staged == {}
    streamer.load(b, streamer.home_slot(b))  # copied again, and right
    _check(b, expected)
    assert streamer.copies == copies + 4  # a once; b staged, given up, copied again; c once
    mgr.detach()


def test_units_kept_as_stored_drop_their_staged_copies():
    mgr, streamer, (a, *_), expected = _streamer_with_widened_reference()
    assert streamer.stage_ahead(a)
    streamer.keep_as_stored([a])  # from now on widened from the device copy
    assert streamer.staged == {} and not streamer.stage_ahead(a)
    widenings = streamer.widenings
    streamer.load(a, streamer.home_slot(a))
    assert streamer.widenings == widenings + 1
    _check(a, expected)
    mgr.detach()
