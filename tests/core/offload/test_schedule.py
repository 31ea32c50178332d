"""The prefetch order the engine learns from the previous step (``SuccessorSchedule``)."""
from diffsynth_core.offload.schedule import SuccessorSchedule


def _step(sched, uses):
    keys = [sched.observe(unit, phase) for unit, phase in uses]
    sched.end_step()
    return keys


FORWARD_BACKWARD = [(0, "F"), (1, "F"), (2, "F"), (3, "F"), (3, "B"), (2, "B"), (1, "B"), (0, "B")]


def test_windows_follow_the_last_step_and_stop_at_its_end():
    sched = SuccessorSchedule()
    _step(sched, FORWARD_BACKWARD)
    streamed = {0, 1, 2, 3}
    first = sched.observe(0, "F")
    assert [k[0] for k in sched.window(first, 2, streamed)] == [1, 2]
    assert sched.window(first, 2, {1, 3}) == [(1, "F", 0), (3, "F", 0)]  # only the units asked for
    keys = [first] + [sched.observe(u, p) for u, p in FORWARD_BACKWARD[1:]]
    last = keys[-1]  # unit 0's backward: nothing follows within the step
    assert sched.window(last, 2, streamed) == []  # nothing crosses a step
