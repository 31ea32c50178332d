"""bench.offload's profile summary: what it says the compute stream waited for, on a hand-made trace
in the format ``torch.profiler`` exports (kernel/gpu_memcpy events with a stream, cuda_runtime calls)."""
from bench.offload import trace_summary


def _kernel(name, ts, dur, stream, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_compute_gaps_name_their_neighbours_and_what_ran_meanwhile():
    trace = {"traceEvents": [
        _kernel("gemm_a", 0, 1000, 7), _kernel("gemm_b", 800, 700, 7),      # overlap: one busy span
        _kernel("gemm_c", 2500, 1000, 7),                                     # 1000 us gap before it
        _kernel("gemm_d", 3550, 50, 7),                                       # 50 us gap: below the floor
        _kernel("Memcpy HtoD", 1400, 800, 13, cat="gpu_memcpy"),             # 700 us of it inside the gap
        {"cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 1600, "dur": 2000},
    ]}
    out = trace_summary(trace)
    assert out["compute_stream"] == "7"
    assert out["streams"]["7"]["busy_ms"] == 2.55 and out["window_ms"] == 3.6
    gaps = out["compute_gaps"]
    assert gaps["count"] == 1 and gaps["total_ms"] == 1.0
    assert gaps["largest"] == [{"ms": 1.0, "after": "gemm_b", "before": "gemm_c", "at_ms": 1.5}]
    assert gaps["other_streams_busy_in_gaps_ms"] == {"13": 0.7}
    assert gaps["host_runtime_in_gaps_ms"] == [["cudaEventSynchronize", 0.9]]


def test_a_lower_gap_floor_counts_the_short_waits_too():
    trace = {"traceEvents": [_kernel("gemm_a", 0, 1000, 7), _kernel("gemm_c", 2000, 1000, 7),
                             _kernel("gemm_d", 3050, 50, 7)]}
    assert trace_summary(trace)["compute_gaps"]["count"] == 1  # the 50 us gap is below the default floor
    gaps = trace_summary(trace, min_gap_us=20)["compute_gaps"]
    assert gaps["count"] == 2 and gaps["total_ms"] == 1.05


def test_the_compute_stream_is_the_one_running_kernels_even_when_a_copy_stream_is_busier():
    # a copy-bound step: the weight stream is busy longer than the compute stream
    trace = {"traceEvents": [_kernel("gemm_a", 0, 300, 7), _kernel("gemm_b", 1000, 300, 7),
                             _kernel("Memcpy HtoD", 0, 1200, 13, cat="gpu_memcpy")]}
    out = trace_summary(trace)
    assert out["compute_stream"] == "7"
    assert out["compute_gaps"]["largest"][0]["after"] == "gemm_a"


def test_the_forward_copy_floor_counts_what_the_budget_cannot_hold_at_the_forward_start():
    from bench.offload import forward_copy_bound

    resident = {"step_s": 0.7, "gpu_forward_s": 0.2, "pinned_h2d_gbps": 50.0}
    # 40 GB of weights under a 20 GB budget: at least 20 GB cross PCIe in the forward, 0.4 s at 50 GB/s
    floor = forward_copy_bound(resident, {"dit_gb": 40.0, "budget_gb": 20.0, "pinned_h2d_gbps": 40.0})
    assert floor["forward_copy_s"] == 0.4 and floor["h2d_gbps"] == 50.0  # the faster rate of the call
    assert abs(floor["step_s"] - 0.9) < 1e-12 and abs(floor["over_resident"] - 0.9 / 0.7) < 1e-12
    # a forward longer than its copies: the floor is the resident step
    roomy = forward_copy_bound(resident, {"dit_gb": 40.0, "budget_gb": 35.0})
    assert roomy["step_s"] == 0.7
