"""The activation offloader's host buffers: exact sizes, reused, idle bytes bounded (pageable here;
the GPU test pins them and checks that steady steps allocate none)."""

from __future__ import annotations

import gc

from diffsynth_core.gradient.activation_offload import HostBuffers

MB = 1 << 20


def test_buffers_have_exact_sizes_and_come_back():
    pool = HostBuffers(pin=False)
    a, after = pool.take(3 * MB + 5)
    assert a.buffer.numel() == 3 * MB + 5 and after == [] and not a.pinned
    pool.give(a, [])
    b, _ = pool.take(3 * MB + 5)
    assert b is a and pool.allocations == 1


def test_a_step_of_fixed_shapes_allocates_only_the_first_time():
    pool = HostBuffers(pin=False)
    sizes = [4 * MB] * 6 + [MB] * 6  # one step: six block inputs, six text inputs
    for _ in range(3):
        held = [pool.take(n)[0] for n in sizes]
        for buffer in reversed(held):  # backward lets go in reverse
            pool.give(buffer, [])
    assert pool.allocations == len(sizes)
    assert pool.most_live_bytes == sum(sizes) and pool.idle_bytes == sum(sizes) and pool.live_bytes == 0


def test_idle_bytes_stay_within_the_largest_working_set():
    pool = HostBuffers(pin=False)
    for size in (8 * MB, 6 * MB, 4 * MB, 2 * MB):  # resolution buckets: a new size every step
        held = [pool.take(size)[0] for _ in range(4)]
        for buffer in held:
            pool.give(buffer, [])
        assert pool.idle_bytes <= pool.most_live_bytes == 32 * MB
    assert sum(b.nbytes for b in pool.all) == pool.idle_bytes  # dropped buffers are forgotten


def test_buffers_go_when_the_pool_does():
    pool = HostBuffers(pin=False)
    buffer, _ = pool.take(MB)
    del pool
    gc.collect()
    assert buffer.buffer.numel() == 0  # released by the finalizer
