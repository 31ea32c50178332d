"""Offload engine benchmarks at real size (run on a CUDA GPU; prints one JSON document).

    python -m bench.offload --cases optim,qwen20b,fp8_loss,determinism [--out FILE] [--quick]

Every case runs each configuration in its own process (``--worker``), so no run inherits another's
allocator, pinned memory or RNG state, and ratios are taken between rows of one invocation.

* ``qwen20b``: Qwen-Image's released DiT layout (60 blocks, 20.4 B parameters, random bf16 weights
  built on the GPU, then moved to host memory for offloaded rows) trained through the real
  ``Trainer`` (flow matching, LoRA r32, checkpointing) at 1024²: all resident; streamed under a
  24 GB budget; fp8 storage under a 16 GB budget (``--qwen-rows`` picks the rows; ``_act``: with the
  checkpointed block inputs in host memory too, ``train.gradient_checkpointing_offload``).  s/step (median), GPU peak (torch and NVML), host
  RAM peak (VmHWM) against the DiT's bytes, planned vs measured host->device bytes per step.
  ``--profile-step K`` adds, per row, how long each CUDA stream was busy in step K + 1 and its
  costliest kernels (the compute stream's idle time is what the step waited for).
* ``flux2``: FLUX.2's released DiTs the same way (``--flux2-rows``): FLUX.2-dev (8 + 48 blocks, 32.2 B
  parameters, 64 GB in bf16) resident and within 24 GB (packed bf16 or fp8 storage), klein 9B and 4B resident
  and within 16 GB; LoRA r32 on DiffSynth's targets, 1024², 512 text tokens, compiled blocks, fused AdamW.
  Each row's s/step over its layout's resident row (``step_over_resident_compiled``) and host peak over the
  DiT's bytes (``host_peak_over_dit``).  Where dev cannot train resident (an 80 GB GPU), ``--flux2-dev-layers
  4,24`` runs every dev row at half depth, the ratio then being that stack's, as ``fp8_loss`` does for Qwen.
* ``fp8_loss``: 100 steps with bf16 storage and with fp8 storage, same samples and noise: the loss difference.
  Qwen-Image at real width but 8 blocks; ``--fp8-loss-layout flux2_dev``: the whole FLUX.2-dev, bf16 resident
  against fp8 within 24 GB, compiled (one row a call: ``--fp8-loss-rows``, ``--fp8-loss-against``).
* ``host_ram``: a released DiT layout (``--layout``, ``--layers``) saved as a diffusers folder, then loaded as
  stage 2 loads it and attached with bf16 and with fp8 storage (runs on the CPU too): the peaks of anonymous and
  file-backed host memory against the DiT's and the arena's bytes.
* ``determinism``: ``train.deterministic`` on CUDA, 4 real-width blocks at 512²: two runs, and a
  run stopped at step 3 and resumed to 6, compared bitwise; the same without deterministic mode;
  s/step at 1024² with and without it (its cost).
* ``optim``: full fine-tuning of a 10 x Linear(4096) fp32 toy (batch 512): all on the GPU, optimizer
  offload stepping after backward, and the optimizer bound to the engine (``bind_optimizer``:
  steps overlapped with the next forward, and with backward too); the CPU AdamW step alone (by
  intra-op threads, and while host<->device copies run); and, for comparison, not optimizer
  offload but AdamW's state kept on the host and paged in during backward, the step on the GPU
  (``gpu_step_in_backward``: weights resident, so a higher GPU peak); and the bound, overlapped
  optimizer with the first 20-50 % of the weights stepped on the GPU during backward
  (``bound_overlap_backward_device_*``, ``device_steps``), their state paged through the host or
  kept on the GPU (``_kept``: ``keep_device_state``); ``_held``: a slot per block (``prefetch=9``,
  each block copied once a step); ``_budget_Xgib``: the slots a GPU memory budget buys instead.
  ``--optim-rows`` picks rows (all_gpu and cpu_adamw_alone always run).  20 steps after 3 of
  warm-up, every queued host step and GPU kernel drained at the end of the timed period.

* ``widen``: widening one real-width Qwen-Image block's weights (340 M, fp8 with per-row scales)
  to bf16 on the GPU: PyTorch's eager two passes against the one-pass Triton kernel the engine
  uses (``widen_cuda``), and whether they agree bit for bit; a plain bf16 copy of the same size
  for scale.

The LoRA stack side by side with musubi-tuner is ``bench/side_by_side.py``.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
from collections import Counter
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB, GIB = 1e9, 2**30


# --- measuring -------------------------------------------------------------------------------------
class PeakSampler:
    """Highest NVML-reported GPU memory in use, sampled every 50 ms on a thread."""

    def __init__(self, index: int = 0):
        self.peak, self._stop = 0, threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle, self._nvml = pynvml.nvmlDeviceGetHandleByIndex(index), pynvml
        except Exception:  # noqa: BLE001 - NVML is optional: report None
            self._nvml = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while self._nvml and not self._stop.wait(0.05):
            self.peak = max(self.peak, self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        return self.peak / GB if self._nvml else None


def _status_bytes(name: str) -> int:
    """One memory line of /proc/self/status (``RssAnon``, ``RssFile``...), in bytes."""
    line = next(l for l in open("/proc/self/status") if l.startswith(f"{name}:"))
    return int(line.split()[1]) * 1024


def host_peak_gb() -> float:
    """This process's resident-set high-water mark (VmHWM)."""
    return _status_bytes("VmHWM") / GB


DEVICE: list[str] = []  # "--device X" for every worker (set by main)
QUICK: list[str] = []  # "--quick" for every worker (set by main)


def _spawn(args: list[str], timeout: int) -> dict:
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.offload", *args, *DEVICE, *QUICK], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- a released DiT layout through the real Trainer --------------------------------------------------
# --layout -> (family, its variant, released layout, the config keys --layers sets: one count per key)
LAYOUTS = {"qwen_image": ("qwen_image", None, "Qwen-Image", ("num_layers",)),
           "flux2_dev": ("flux2", "dev", "FLUX.2-dev", ("num_layers", "num_single_layers")),
           "flux2_klein_4b": ("flux2", "klein-base-4b", "FLUX.2-klein-4B", ("num_layers", "num_single_layers")),
           "flux2_klein_9b": ("flux2", "klein-base-9b", "FLUX.2-klein-9B", ("num_layers", "num_single_layers"))}


def _layout_model(a, device: torch.device):
    """The family spec and the DiT of ``--layout`` with random bf16 weights made on ``device``, ``--layers``
    blocks deep (``--quick``: the family's tiny widths)."""
    import importlib

    from diffsynth_core.models import get_family
    from diffsynth_core.models.random_models import build_random_transformer

    family, variant, released, depth_keys = LAYOUTS[a.layout]
    module = importlib.import_module(f"diffsynth_core.models.{family}")
    real = module.TRANSFORMER_CONFIGS["tiny" if a.quick else released]
    depths = [int(n) for n in str(a.layers).split(",")] if a.layers else [real[k] for k in depth_keys]
    layout = {"w": {**real, **dict(zip(depth_keys, depths))}}
    spec = get_family(family, variant)
    return spec, build_random_transformer(module.TRANSFORMER_CLASS, layout, "w", torch.bfloat16, device)


def qwen_worker(a) -> dict:
    from diffsynth_core.training.device import avoid_broken_kernels, configure_determinism
    from diffsynth_core.training.loop import Trainer
    from stages.config import OffloadSection, TrainSection

    configure_determinism(a.deterministic, 0)  # before the first cuBLAS call of this process
    device = avoid_broken_kernels(a.device)
    cuda = device.type == "cuda"
    spec, model = _layout_model(a, device)
    dit_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if a.offload:  # weights live in host memory, as a loaded model's would
        model.to("cpu")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sampler = PeakSampler()
    samples = []
    for seed in range(4):
        latents, cond = spec.dummy_inputs(model.config, batch=1, height=a.height, width=a.height, text_len=a.text_len,
                                          seed=seed)
        samples.append({"latents": latents[0], **{k: v[0] for k, v in cond.items()}})
    train = TrainSection(lora_rank=32, max_steps=a.steps, save_steps=a.save_steps, seed=0, gradient_checkpointing=True,
                         device=a.device, deterministic=a.deterministic, gradient_checkpointing_offload=a.act_offload,
                         compile_blocks=a.compile, optimizer_args={"fused": True} if a.fused_adamw else {},
                         lora_narrow_inputs=a.narrow_lora_input)
    offload = OffloadSection(enable_model_cpu_offload=a.offload, vram_budget_gb=a.budget_gib,
                             storage_dtype=a.storage or None, prefetch=a.prefetch,
                             optimizer_state_on_host=a.state_on_host)
    stamps: list[float] = []
    profiler = StepProfiler(a.profile_step)

    lag = GpuLag([block for name in spec.block_container_names for block in getattr(model, name)]) if cuda else None
    phases = ForwardShare(model) if cuda else None

    def clock(step, _model):
        if cuda:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        profiler.after_step(len(stamps))
        if lag is not None:
            lag.step_ended()
        if phases is not None:
            phases.step_ended()
    out_dir = a.out_dir or tempfile.mkdtemp()
    trainer = Trainer(spec, model, samples, train, offload, out_dir, device=device, progress=False, callbacks=[clock])
    if a.per_tensor_widening:  # the widening as it was: a launch per tensor (widening.py)
        from diffsynth_core.offload.widening import UnitWidening, widen_each

        UnitWidening.run = lambda self, src, dst, views: widen_each(self.unit, src, views)
    if a.trace_dir:  # name the engine's host work in the kept trace
        _annotate_host_work()
    issued = _stamp_backward_issued(trainer)
    t0 = time.perf_counter()
    result = trainer.fit()
    steps = [b - a_ for a_, b in zip([t0] + stamps, stamps)]
    out = {"layers": a.layers, "pixels": a.height, "dit_gb": dit_bytes / GB, "losses": result.losses,
           "step_s": statistics.median(steps[a.warmup:]) if len(steps) > a.warmup else None, "steps_s": steps,
           "gpu_peak_torch_gb": torch.cuda.max_memory_allocated() / GB if cuda else None,
           "resumed_from": result.resumed_from}
    # How far ahead of the GPU the host is: the time it took to queue a step's forward and backward,
    # and the rest of the step (mostly waiting for the GPU to finish what was queued).
    issue = [i - start for start, i in zip([t0] + stamps, issued)]
    rest = [end - i for i, end in zip(issued, stamps)]
    if len(issue) > a.warmup:
        out.update(host_issue_s=statistics.median(issue[a.warmup:]), after_issue_s=statistics.median(rest[a.warmup:]))
    if lag is not None:
        out["gpu_lag_ms"] = lag.summary(a.warmup)
        out.update(phases.summary(a.warmup))
    from diffsynth_core.gradient import activation_offloader

    offloader = activation_offloader(result.model) or activation_offloader(model)
    if offloader is not None:  # per step: fetched_on_demand counts what backward waited for
        out["activation_offload"] = offloader.stats()
    if result.offload is not None:
        rep = result.offload.report()
        out.update({k: rep[k] for k in ("budget_units", "compact_units", "streamed_units", "stalls", "pinned",
                                          "device_widenings", "staged_ahead", "h2d_copies")},
                   arena_gb=rep["arena_bytes"] / GB, planned_h2d_gb_per_step=(rep["planned_h2d_bytes_per_step"] or 0) / GB,
                   h2d_gb_per_step=rep["last_step_h2d_bytes"] / GB, planned_peak_gb=(rep["planned_peak_bytes"] or 0) / GB,
                   budget_gb=(rep["budget_bytes"] or 0) / GB)
        if result.host_state is not None:
            out["optimizer_state_on_host"] = result.host_state.stats
        result.offload.detach(restore_frozen=False)  # what the LoRA export does
    profile = profiler.summary(keep=a.trace_dir / f"{a.row_name}.json.gz" if a.trace_dir else None)
    if profile is not None:
        out["profile"] = profile
    out["lora"] = {k: v.detach().float().cpu() for k, v in result.model.named_parameters() if "lora_" in k} \
        if a.keep_lora else None
    out.update(gpu_peak_nvml_gb=sampler.stop(), host_peak_gb=host_peak_gb())
    out["host_peak_over_dit"] = out["host_peak_gb"] / out["dit_gb"]
    if cuda:  # after the host peak is read: the probe pins 1 GiB of its own
        from bench.dit_stack import pinned_bandwidth

        out["pinned_h2d_gbps"] = pinned_bandwidth(device)
    return out


class GpuLag:
    """How far the GPU runs behind the host, at each block's start (forward and recompute): the host
    records an event there; after the step, the event's GPU time is placed on the host's clock by
    an event recorded on the idle GPU just after the previous step's synchronize.  A lag near zero
    means the GPU waits for the host (the step is host-bound); a lag of tens of ms means the host
    runs ahead (GPU-bound: then the step waits for kernels or copies)."""

    def __init__(self, blocks):
        self.origin: tuple[float, object] | None = None
        self.marks: list[tuple[float, object]] = []
        self.steps: list[list[float]] = []
        self._hooks = [b.register_forward_pre_hook(self._mark) for b in blocks]

    @staticmethod
    def _now() -> tuple[float, object]:
        """(host time, an event recorded on the compute stream now)."""
        return time.perf_counter(), torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))

    def _mark(self, _module, _args):
        if self.origin is not None:
            self.marks.append(self._now())

    def step_ended(self) -> None:  # the GPU is idle: every event of the step has completed
        if self.origin is not None and self.marks:
            t0, e0 = self.origin
            self.steps.append([(t0 + e0.elapsed_time(ev) / 1e3 - host) * 1e3 for host, ev in self.marks])
        self.marks = []
        self.origin = self._now()

    def summary(self, warmup: int) -> dict:
        steps = self.steps[warmup:] or self.steps
        every = [x for s in steps for x in s]
        if not every:
            return {}
        return {"median": statistics.median(every), "p10": _quantile(every, 0.1), "p90": _quantile(every, 0.9),
                "per_step_median": [round(statistics.median(s), 1) for s in steps]}


def _annotate_host_work() -> None:
    """Wrap the offload engine's per-use hook and the activation offloader's pack / unpack in
    profiler ranges (``user_annotation`` events), so a trace shows the host time each takes."""
    from diffsynth_core.gradient.activation_offload import ActivationOffloader
    from diffsynth_core.offload.manager import OffloadTrainingManager

    for cls, name in ((OffloadTrainingManager, "_use"), (ActivationOffloader, "pack"), (ActivationOffloader, "unpack")):
        def wrapped(self, *args, _fn=getattr(cls, name), _label=f"{cls.__name__}.{name}", **kwargs):
            with torch.profiler.record_function(_label):
                return _fn(self, *args, **kwargs)
        setattr(cls, name, wrapped)


class ForwardShare:
    """The forward's share of a step on the GPU's clock: from the step's start (an event recorded on
    the idle GPU after the previous step's synchronize) to the end of the model's forward (a forward
    hook: recompute under checkpointing calls the blocks, not the model), and from there to the
    step's end (loss, recompute + backward, optimizer step).  What bounds an offloaded step from
    below: every weight not on the device when the forward starts must cross PCIe during it."""

    def __init__(self, model):
        self.start = self.forward_end = None
        self.forward_s: list[float] = []
        self.rest_s: list[float] = []
        model.register_forward_hook(self._forward_ended)

    @staticmethod
    def _event():
        return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))

    def _forward_ended(self, _module, _args, _out):
        if self.start is not None and self.forward_end is None:
            self.forward_end = self._event()

    def step_ended(self) -> None:  # after a synchronize: every event of the step has completed
        end = self._event()
        end.synchronize()
        if self.start is not None and self.forward_end is not None:
            self.forward_s.append(self.start.elapsed_time(self.forward_end) / 1e3)
            self.rest_s.append(self.forward_end.elapsed_time(end) / 1e3)
        self.start, self.forward_end = end, None

    def summary(self, warmup: int) -> dict:
        fwd, rest = self.forward_s[warmup:] or self.forward_s, self.rest_s[warmup:] or self.rest_s
        return {"gpu_forward_s": statistics.median(fwd), "gpu_after_forward_s": statistics.median(rest)} if fwd else {}


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def _stamp_backward_issued(trainer) -> list[float]:
    """Times at which each step's backward had been queued (the trainer then prepares the next
    batch, ``prefetch.py``): the host's share of the step, when the GPU is ahead of it."""
    stamps: list[float] = []
    prepare = trainer.next_batch.prepare_ahead

    def stamped(batch):
        stamps.append(time.perf_counter())
        return prepare(batch)
    trainer.next_batch.prepare_ahead = stamped
    return stamps


DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories that ran on a CUDA stream


class StepProfiler:
    """``--profile-step K``: PyTorch's profiler over training step K + 1 (after K steps), summarised
    per CUDA stream (``summary()``, after training, so the export is not timed as a step): how long
    each stream was busy within the step (union of its kernels and copies), and its five costliest
    names.  The compute stream's idle time is what the step spent waiting (for copies, widenings or
    the host); ``min_gap_us``: the shortest idle stretch counted as a gap."""

    def __init__(self, step: int, min_gap_us: float = 100.0):
        self.step, self.prof, self.min_gap_us = step, None, min_gap_us

    def after_step(self, done: int) -> None:
        if not self.step:
            return
        if done == self.step:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.start()
        elif done == self.step + 1 and self.prof is not None:
            self.prof.stop()

    def summary(self, keep: Path | None = None) -> dict | None:
        """The trace's summary; ``keep``: also write its device events and CUDA runtime calls there
        (gzipped JSON, for a look beyond the summary; a 60-block step's whole trace is too large)."""
        if self.prof is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self.prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            # and the host's operators of 50 us or more (where a host-bound step spends its time)
            kept = [e for e in trace.get("traceEvents", [])
                    if e.get("cat") in (*DEVICE_EVENTS, "cuda_runtime", "user_annotation")
                    or (e.get("cat") == "cpu_op" and e.get("dur", 0) >= 50)]
            with gzip.open(keep, "wt") as f:
                json.dump({"traceEvents": kept}, f)
        return trace_summary(trace, self.min_gap_us)


def trace_summary(trace: dict, min_gap_us: float = 100.0) -> dict:
    """Per stream: busy ms (overlaps counted once), event count, top names by total ms.  For the
    busiest stream (the compute stream) also its idle gaps: the largest ones with the kernels either
    side, how busy each other stream was inside all gaps, and which CUDA runtime calls the host sat
    in meanwhile (a long ``cudaEventSynchronize`` there means the host waited, not the GPU)."""
    events = [e for e in trace.get("traceEvents", [])
              if e.get("cat") in DEVICE_EVENTS and "dur" in e]
    if not events:
        return {"streams": {}}
    start = min(e["ts"] for e in events)
    window = max(e["ts"] + e["dur"] for e in events) - start
    streams: dict[str, list[dict]] = {}
    for e in events:
        streams.setdefault(str(e.get("args", {}).get("stream", e.get("tid"))), []).append(e)
    out, spans = {}, {}
    for sid, evs in streams.items():
        spans[sid] = _union(evs)
        names: dict[str, float] = {}
        for e in evs:
            names[e["name"][:80]] = names.get(e["name"][:80], 0.0) + e["dur"]
        top = sorted(names.items(), key=lambda kv: -kv[1])[:12]  # five left a third of the stack step's kernel time out
        out[sid] = {"busy_ms": sum(hi - lo for lo, hi, _, _ in spans[sid]) / 1e3, "events": len(evs),
                    "top_ms": [[n, round(d / 1e3, 2)] for n, d in top]}
    # the stream that runs the kernels: a copy stream can be busier (a copy-bound step) with few events
    compute = max(out, key=lambda sid: (sum(e.get("cat") == "kernel" for e in streams[sid]), out[sid]["busy_ms"]))
    runtime = [e for e in trace.get("traceEvents", []) if e.get("cat") == "cuda_runtime" and "dur" in e]
    return {"window_ms": window / 1e3, "compute_stream": compute, "streams": out,
            "compute_gaps": _gaps(spans, compute, runtime, min_gap_us)}


def _union(evs: list[dict]) -> list[tuple]:
    """Merged busy intervals (lo, hi, first name, last name) of one stream's events."""
    merged: list[list] = []
    for e in sorted(evs, key=lambda e: e["ts"]):
        lo, hi = e["ts"], e["ts"] + e["dur"]
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1][1], merged[-1][3] = hi, e["name"][:60]
        else:
            merged.append([lo, hi, e["name"][:60], e["name"][:60]])
    return [tuple(m) for m in merged]


def _overlap(spans, lo: float, hi: float, starts: list[float] | None = None) -> float:
    """Time within [lo, hi] that ``spans`` (sorted, disjoint) cover; ``starts``: their start times,
    so only the spans that can reach into [lo, hi] are visited."""
    first = max(0, bisect.bisect_right(starts, lo) - 1) if starts is not None else 0
    covered = 0.0
    for a, b, *_ in spans[first:]:
        if a >= hi:
            break
        covered += max(0.0, min(hi, b) - max(lo, a))
    return covered


def _gaps(spans: dict, compute: str, runtime: list[dict], min_us: float = 100.0) -> dict:
    busy = spans[compute]
    gaps = [(busy[i][1], busy[i + 1][0], busy[i][3], busy[i + 1][2]) for i in range(len(busy) - 1)
            if busy[i + 1][0] - busy[i][1] >= min_us]
    others = {}
    for sid, s in spans.items():
        if sid != compute:
            starts = [a for a, *_ in s]
            others[sid] = round(sum(_overlap(s, lo, hi, starts) for lo, hi, *_ in gaps) / 1e3, 2)
    gap_starts = [lo for lo, *_ in gaps]
    host: dict[str, float] = {}
    for e in runtime:
        inside = _overlap(gaps, e["ts"], e["ts"] + e["dur"], gap_starts)
        if inside:
            host[e["name"]] = host.get(e["name"], 0.0) + inside
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:12]
    return {"count": len(gaps), "total_ms": round(sum(hi - lo for lo, hi, *_ in gaps) / 1e3, 2),
            "other_streams_busy_in_gaps_ms": others,
            "host_runtime_in_gaps_ms": sorted([[n, round(d / 1e3, 2)] for n, d in host.items()],
                                              key=lambda nd: -nd[1])[:6],
            "largest": [{"ms": round((hi - lo) / 1e3, 2), "after": a, "before": b,
                         "at_ms": round((lo - busy[0][0]) / 1e3, 1)} for lo, hi, a, b in largest]}


def qwen_rows(rows: dict[str, list[str]], timeout: int) -> dict:
    res = {}
    for name, args in rows.items():
        res[name] = _spawn(["--worker", "qwen", *args], timeout)
        _save_partial(res)
    return res


PARTIAL: dict = {}  # main's --out, its document so far and the running case (set by main)


def _save_partial(rows: dict) -> None:
    """The running case's rows so far, written to --out: a run cut short keeps the rows it measured."""
    if PARTIAL.get("path"):
        doc = {**PARTIAL["doc"], PARTIAL["case"]: {"partial": True, **rows}}
        Path(PARTIAL["path"]).write_text(json.dumps(doc, indent=1))


def case_qwen20b(a) -> dict:
    layers, px = ("4", "64") if a.quick else ("60", "1024")
    common = ["--layers", layers, "--height", px, "--steps", str(a.qwen_steps), "--warmup", "3"]
    if a.profile_step:  # every row profiles that step (see StepProfiler)
        common += ["--profile-step", str(a.profile_step)]
    fp8_16 = [*common, "--offload", "--budget-gib", f"{16e9 / GIB:.3f}", "--storage", "float8_e4m3fn"]
    bf16_24 = [*common, "--offload", "--budget-gib", f"{24e9 / GIB:.3f}"]
    rows = {"resident": common, "budget_24gb": bf16_24, "budget_24gb_act": [*bf16_24, "--act-offload"],
            "fp8_budget_24gb": [*bf16_24, "--storage", "float8_e4m3fn"],
            "packed_budget_24gb": [*bf16_24, "--storage", "packed_bfloat16"],
            "packed_budget_24gb_act": [*bf16_24, "--storage", "packed_bfloat16", "--act-offload"],
            "fp8_budget_16gb": fp8_16, "fp8_budget_16gb_act": [*fp8_16, "--act-offload"],
            "fp8_budget_16gb_prefetch2": [*fp8_16, "--prefetch", "2"],
            "fp8_budget_16gb_pertensor": [*fp8_16, "--per-tensor-widening"]}
    rows.update({f"{name}_compiled": [*args, "--compile"] for name, args in list(rows.items())
                 if name in ("resident", "budget_24gb", "budget_24gb_act", "fp8_budget_24gb", "fp8_budget_16gb",
                             "fp8_budget_16gb_act", "packed_budget_24gb", "packed_budget_24gb_act")})
    # torch's fused AdamW kernel instead of its for-each one (no state-sized temporaries, fewer launches)
    rows.update({f"{name}_fused": [*rows[name], "--fused-adamw"]
                 for name in ("resident_compiled", "budget_24gb_compiled", "budget_24gb_act_compiled",
                              "fp8_budget_16gb_compiled", "fp8_budget_16gb_act_compiled")})
    # offload.optimizer_state_on_host: AdamW's moments wait in host memory between steps
    rows.update({f"{name}_hoststate": [*rows[name], "--state-on-host"]
                 for name in ("budget_24gb_compiled_fused", "budget_24gb_act_compiled_fused",
                              "fp8_budget_16gb_compiled_fused")})
    # train.lora_narrow_inputs: the adapters save their bf16 input, not peft's fp32 copy
    rows.update({f"{name}_narrow": [*rows[name], "--narrow-lora-input"] for name in ("resident", "resident_compiled")})
    wanted = ([] if a.skip_resident else ["resident"]) + a.qwen_rows.split(",")
    unknown = sorted(set(wanted) - set(rows))
    if unknown:
        raise SystemExit(f"--qwen-rows: no row named {', '.join(unknown)} (rows: {', '.join(rows)})")
    named: dict[str, list[str]] = {}  # a row asked for again runs again, named name_2, name_3 ...
    asked: Counter[str] = Counter()
    for name in wanted:
        asked[name] += 1
        run_name = name if asked[name] == 1 else f"{name}_{asked[name]}"
        named[run_name] = [*rows[name], *(["--trace-dir", str(a.trace_dir), "--row-name", run_name]
                                          if a.trace_dir else [])]
    res = qwen_rows(named, 420)
    resident = res.get("resident", {}).get("step_s")
    compiled = res.get("resident_compiled", {}).get("step_s")
    for name, row in res.items():
        if resident and row.get("step_s") and name != "resident":
            row["step_over_resident"] = row["step_s"] / resident
        if compiled and row.get("step_s") and "_compiled" in name and name != "resident_compiled":
            row["step_over_resident_compiled"] = row["step_s"] / compiled
        base = res.get("resident_compiled" if "_compiled" in name else "resident", {})
        if row.get("budget_gb") and base.get("gpu_forward_s") and "fp8" not in name and "packed" not in name:  # bf16 bytes only
            row["lower_bound"] = forward_copy_bound(base, row)
    return res


# --- FLUX.2: dev within 24 GB, klein within 16 GB --------------------------------------------------------
# (layout, GPU budget in GB) of each row prefix; rows: resident, streamed in bf16, packed or fp8, with the
# checkpointed block inputs in host memory (_act); all with compiled blocks (ratios to resident_compiled).
FLUX2_LAYOUTS = {"dev": ("flux2_dev", 24), "klein9b": ("flux2_klein_9b", 16), "klein4b": ("flux2_klein_4b", 16)}
FLUX2_DEFAULT_ROWS = ("dev_resident_compiled", "dev_packed_budget_24gb_compiled", "dev_fp8_budget_24gb_compiled",
                      "klein9b_resident_compiled", "klein9b_budget_16gb_compiled",
                      "klein9b_packed_budget_16gb_compiled", "klein4b_resident_compiled",
                      "klein4b_budget_16gb_compiled")


def flux2_row_args(a) -> dict[str, list[str]]:
    """Every flux2 row's worker arguments: LoRA r32 at 1024², 512 text tokens, compiled blocks, fused AdamW."""
    px = "64" if a.quick else "1024"
    rows = {}
    for prefix, (layout, gb) in FLUX2_LAYOUTS.items():
        common = ["--layout", layout, "--height", px, "--steps", str(a.qwen_steps), "--warmup", "3", "--compile",
                  "--fused-adamw"]
        if prefix == "dev" and a.flux2_dev_layers:
            common += ["--layers", a.flux2_dev_layers]
        budget = [*common, "--offload", "--budget-gib", f"{gb * 1e9 / GIB:.3f}"]
        rows.update({f"{prefix}_resident_compiled": common, f"{prefix}_budget_{gb}gb_compiled": budget,
                     f"{prefix}_packed_budget_{gb}gb_compiled": [*budget, "--storage", "packed_bfloat16"],
                     f"{prefix}_fp8_budget_{gb}gb_compiled": [*budget, "--storage", "float8_e4m3fn"],
                     f"{prefix}_packed_budget_{gb}gb_act_compiled": [*budget, "--storage", "packed_bfloat16",
                                                                     "--act-offload"]})
    return rows


def case_flux2(a) -> dict:
    """FLUX.2's released DiTs (dev 32 B, klein 9B / 4B) through the real Trainer; each row against its layout's
    resident row (step time) and its DiT's bytes (host peak)."""
    rows = flux2_row_args(a)
    wanted = a.flux2_rows.split(",")
    unknown = sorted(set(wanted) - set(rows))
    if unknown:
        raise SystemExit(f"--flux2-rows: no row named {', '.join(unknown)} (rows: {', '.join(rows)})")
    res = {}
    for name in wanted:
        res[name] = _spawn(["--worker", "dit", *rows[name]], 900)
        _save_partial(res)
    for name, row in res.items():
        resident = res.get(f"{name.split('_', 1)[0]}_resident_compiled", {}).get("step_s")
        if resident and row.get("step_s") and "_resident" not in name:
            row["step_over_resident_compiled"] = row["step_s"] / resident
    return res


def forward_copy_bound(resident: dict, row: dict) -> dict:
    """A floor under any schedule of a budgeted row: the weights on the device when the forward
    starts are at most the budget, so at least ``DiT bytes - budget`` cross PCIe during the forward
    (the forward cannot begin before the previous step ends, nor the backward before the forward
    ends); the rest of the step is at least the resident step's rest.  Generous on purpose: the
    whole budget counted as weights, the fastest copy rate of the call, every copy overlapped."""
    rate = max(r for r in (resident.get("pinned_h2d_gbps"), row.get("pinned_h2d_gbps")) if r)
    forward = resident["gpu_forward_s"]
    copy_s = max(0.0, row["dit_gb"] - row["budget_gb"]) / rate
    step_s = resident["step_s"] - forward + max(forward, copy_s)
    return {"step_s": step_s, "over_resident": step_s / resident["step_s"], "forward_copy_s": copy_s,
            "resident_forward_s": forward, "h2d_gbps": rate}


# --fp8-loss-layout -> (its blocks, bf16 row's arguments, fp8 row's arguments, a row's time limit in s).  Qwen-Image:
# 8 real-width blocks, both rows streamed; FLUX.2-dev: the whole 32 B DiT as its perf rows run (compiled, fused
# AdamW), bf16 resident against fp8 within 24 GB.
FP8_LOSS_LAYOUTS = {
    "qwen_image": ("8", ["--offload"], ["--offload", "--storage", "float8_e4m3fn"], 300),
    "flux2_dev": ("8,48", ["--compile", "--fused-adamw"],
                  ["--compile", "--fused-adamw", "--offload", "--budget-gib", f"{24e9 / GIB:.3f}",
                   "--storage", "float8_e4m3fn"], 560)}


def case_fp8_loss(a) -> dict:
    """100 steps with bf16 and with fp8 storage, the same samples and noise: how far the losses drift.
    ``--fp8-loss-rows`` runs one row (two FLUX.2-dev rows of 100 steps outlast one 600 s device call);
    ``--fp8-loss-against FILE`` takes the rows missing here from an earlier run's JSON."""
    layers, bf16, fp8, timeout = FP8_LOSS_LAYOUTS[a.fp8_loss_layout]
    px, steps = ("64", "6") if a.quick else ("1024", "100")
    common = ["--layout", a.fp8_loss_layout, "--layers", a.layers or ("2" if a.quick else layers), "--height", px,
              "--steps", steps, "--warmup", "3"]
    rows = {"bf16_storage": [*common, *bf16], "fp8_storage": [*common, *fp8]}
    res = qwen_rows({name: rows[name] for name in a.fp8_loss_rows.split(",")}, timeout)
    if a.fp8_loss_against:
        earlier = json.loads(Path(a.fp8_loss_against).read_text())
        for name, row in earlier["fp8_loss"].items():
            if name in rows and name not in res:
                res[name] = {**row, "from": a.fp8_loss_against, "device": earlier.get("device")}
    a_, b = res.get("bf16_storage", {}).get("losses"), res.get("fp8_storage", {}).get("losses")
    if a_ and b:
        res["mean_loss_bf16"], res["mean_loss_fp8"] = statistics.mean(a_), statistics.mean(b)
        res["mean_loss_rel_diff"] = abs(res["mean_loss_fp8"] - res["mean_loss_bf16"]) / res["mean_loss_bf16"]
        res["per_step_rel_diff_median"] = statistics.median(abs(x - y) / y for x, y in zip(b, a_))
        res["per_step_rel_diff_max"] = max(abs(x - y) / y for x, y in zip(b, a_))
        res["last10_rel_diff"] = abs(statistics.mean(b[-10:]) - statistics.mean(a_[-10:])) / statistics.mean(a_[-10:])
    return res


class HostSampler:
    """Highest anonymous (``RssAnon``) and file-backed (``RssFile``: mapped weight files, which the kernel
    may drop and read again) resident memory of this process, sampled every 5 ms on a thread."""

    def __init__(self):
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            self._read()
            if self._stop.wait(0.005):
                return

    def _read(self):
        for name in self.peak:
            self.peak[name] = max(self.peak[name], _status_bytes(name))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._read()
        return {f"{k.lower()}_peak_gb": v / GB for k, v in self.peak.items()}


def host_ram_worker(a) -> dict:
    """``--out-dir``'s DiT loaded as stage 2 loads it (``load_component``: diffusers reads the safetensors
    files) and attached to the engine with ``--storage``: host memory at its peak against the DiT's bytes."""
    from diffsynth_core.models.loading import load_component
    from diffsynth_core.offload import OffloadTrainingManager

    before = _status_bytes("RssAnon") / GB  # the interpreter and its libraries
    sampler = HostSampler()
    model = load_component(Path(a.out_dir), "transformer", torch.bfloat16).requires_grad_(False)
    dit_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loaded = {k.replace("_peak", "_after_load"): v for k, v in sampler.stop().items()}
    sampler = HostSampler()
    device = "cuda" if torch.cuda.is_available() and a.device == "cuda" else "cpu"
    storage = getattr(torch, a.storage) if a.storage.startswith("float8") else a.storage or None
    manager = OffloadTrainingManager(model, device, storage_dtype=storage,
                                     vram_budget_gb=a.budget_gib or 0.0)
    arena = manager.report()["arena_bytes"]
    out = {"device": device, "storage": a.storage or "bfloat16", "dit_gb": dit_bytes / GB, "arena_gb": arena / GB,
           "rssanon_before_load_gb": before, **loaded, **sampler.stop(), "vm_hwm_gb": host_peak_gb()}
    weights_anon = max(out["rssanon_peak_gb"], out["rssanon_after_load_gb"]) - before
    out["anon_peak_over_dit"] = weights_anon / out["dit_gb"]  # over what the interpreter held before
    out["anon_peak_over_arena"] = weights_anon / out["arena_gb"]
    return out


def case_host_ram(a) -> dict:
    """A released DiT layout (``--layout``, ``--layers``) saved as a diffusers folder, then loaded and attached
    with bf16 and with fp8 storage, each in its own process: the host peak of the path a user's run takes."""
    import importlib

    module = importlib.import_module(f"diffsynth_core.models.{LAYOUTS[a.layout][0]}")
    folder = Path(tempfile.mkdtemp(prefix="host-ram-"))
    try:
        made_on = torch.device("cuda" if torch.cuda.is_available() and a.device == "cuda" else "cpu")
        model = _layout_model(a, made_on)[1]  # random weights are made fastest on the GPU
        model.to("cpu").save_pretrained(folder / "transformer")
        del model
        (folder / "model_index.json").write_text(json.dumps(
            {"_class_name": "bench", "transformer": ["diffusers", module.TRANSFORMER_CLASS]}))
        base = ["--worker", "host_ram", "--out-dir", str(folder)]
        res = {"layout": a.layout, "layers": a.layers or "released"}
        for name, storage in (("bf16_storage", ""), ("fp8_storage", "float8_e4m3fn")):
            res[name] = _spawn([*base, *(["--storage", storage] if storage else [])], 1200)
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def case_determinism(a) -> dict:
    layers, px = ("2", "64") if a.quick else ("4", "512")
    tmp = Path(tempfile.mkdtemp())
    base = ["--layers", layers, "--height", px, "--warmup", "1", "--save-steps", "3", "--keep-lora", "--offload"]
    runs = {}
    for name, extra in {"det_a": ["--deterministic", "--steps", "6"], "det_b": ["--deterministic", "--steps", "6"],
                        "det_stop": ["--deterministic", "--steps", "3"], "det_resume": ["--deterministic", "--steps", "6"],
                        "plain_a": ["--steps", "6"], "plain_b": ["--steps", "6"]}.items():
        out_dir = tmp / ("resumed" if name in ("det_stop", "det_resume") else name)
        runs[name] = _spawn(["--worker", "qwen", *base, *extra, "--out-dir", str(out_dir), "--lora-file",
                             str(tmp / f"{name}.pt")], 300)
    res = {name: {k: v for k, v in r.items() if k in ("losses", "step_s", "error", "resumed_from")}
           for name, r in runs.items()}
    lora = {n: torch.load(tmp / f"{n}.pt") for n in runs if (tmp / f"{n}.pt").exists()}

    def same(x, y):
        return x in lora and y in lora and all(torch.equal(lora[x][k], lora[y][k]) for k in lora[x])
    res["deterministic_runs_bitwise_equal"] = same("det_a", "det_b")
    res["deterministic_resume_bitwise_equal"] = same("det_a", "det_resume")
    res["plain_runs_bitwise_equal"] = same("plain_a", "plain_b")
    if "losses" in runs["plain_a"] and "losses" in runs["plain_b"]:
        res["plain_max_loss_diff"] = max(abs(x - y) for x, y in zip(runs["plain_a"]["losses"], runs["plain_b"]["losses"]))
    cost_px, cost_layers = ("64", "2") if a.quick else ("1024", "8")
    cost = ["--layers", cost_layers, "--height", cost_px, "--steps", "8", "--warmup", "3"]
    res["cost"] = {"plain": _spawn(["--worker", "qwen", *cost], 300),
                   "deterministic": _spawn(["--worker", "qwen", *cost, "--deterministic"], 300)}
    for row in res["cost"].values():
        row.pop("losses", None)
    if all(r.get("step_s") for r in res["cost"].values()):
        res["cost"]["slowdown"] = res["cost"]["deterministic"]["step_s"] / res["cost"]["plain"]["step_s"]
    return res


def case_widen(a) -> dict:
    from diffsynth_core.offload import widen_cuda
    from diffsynth_core.offload.quant import quantize_rows

    dev = torch.device(a.device)
    rows, cols = (64, 128) if a.quick else (12288, 27648)  # 340 M weights: one Qwen-Image block
    q, scales = quantize_rows(torch.randn(rows, cols, device=dev) * 0.02, torch.float8_e4m3fn)
    out, eager = (torch.empty(rows, cols, dtype=torch.bfloat16, device=dev) for _ in range(2))

    def eager_widen():
        eager.copy_(q).mul_(scales.view(-1, 1))

    def ms(fn, n: int = 20) -> float:
        fn()
        if dev.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n * 1e3
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    res = {"weights": rows * cols, "eager_ms": ms(eager_widen), "bf16_copy_ms": ms(lambda: out.copy_(eager))}
    if widen_cuda.widen_rows(q, scales, out):
        res["triton_ms"] = ms(lambda: widen_cuda.widen_rows(q, scales, out))
        res["bitwise_equal"] = bool(torch.equal(out.view(torch.int16), eager.view(torch.int16)))
        res["speedup"] = res["eager_ms"] / res["triton_ms"]
    res["unit"] = _widen_unit(a, dev, torch.float8_e4m3fn)
    res["unit_packed"] = _widen_unit(a, dev, "packed_bfloat16")
    return res


def _widen_unit(a, dev: torch.device, storage) -> dict:
    """One real-width Qwen-Image block stored in fp8 (or packed bf16), widened from a device copy
    into a slot: tensor by tensor against the batched ``widening.UnitWidening``: host time to issue
    one widening (what the training step pays), GPU time, and whether both give the same bits."""
    from diffsynth_core.models import qwen_image
    from diffsynth_core.models.random_models import build_random_transformer
    from diffsynth_core.offload.arena import HostArena, typed_view
    from diffsynth_core.offload.plan import build_plan
    from diffsynth_core.offload.widening import UnitWidening, widen_each

    real = qwen_image.TRANSFORMER_CONFIGS["tiny" if a.quick else "Qwen-Image"]
    model = build_random_transformer(qwen_image.TRANSFORMER_CLASS, {"w": {**real, "num_layers": 2}}, "w",
                                     torch.bfloat16, dev).requires_grad_(False)
    plan = build_plan(model, dev, "block", None, False, storage)
    originals = [r.param.data.clone() for r in plan.units[0].tensors]
    arena = HostArena(plan.arena_bytes)
    plan.fill_arena(arena)
    unit = plan.units[0]
    src = arena.buffer.narrow(0, unit.host_offset, unit.host_bytes).to(dev)
    batched = UnitWidening(unit, dev)
    outs = {}
    res = {"tensors": len(unit.tensors), "fp8_tensors": sum(r.quantized for r in unit.tensors),
           "packed_tensors": sum(r.packed for r in unit.tensors), "escapes": unit.escapes,
           "stored_over_widened_bytes": unit.host_bytes / unit.dev_bytes,
           "batched_launch_groups": len(batched.groups) + len(batched.packed_groups)}
    for name, widen in (("per_tensor", lambda dst, views: widen_each(unit, src, views)),
                        ("batched", lambda dst, views: batched.run(src, dst, views))):
        dst = torch.zeros(unit.dev_bytes, dtype=torch.uint8, device=dev)
        views = [typed_view(dst, r.dev_offset, r.compute_dtype, r.shape) for r in unit.tensors]
        widen(dst, views)  # compiles the kernel
        if dev.type == "cuda":
            torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            widen(dst, views)
        host = (time.perf_counter() - t0) / n
        if dev.type == "cuda":
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / n
        res[name] = {"host_us_per_unit": host * 1e6, "wall_us_per_unit": total * 1e6}
        outs[name] = dst
    if dev.type == "cuda":
        res["batched"].update(_kernels_alone(unit, batched, src, torch.empty_like(outs["batched"])))
    # the tensors only: the kernels may write the alignment padding between them
    fast, slow = ([typed_view(outs[k], r.dev_offset, r.compute_dtype, r.shape) for r in unit.tensors]
                  for k in ("batched", "per_tensor"))
    res["bitwise_equal"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fast, slow))
    if storage == "packed_bfloat16":  # lossless: the very bits of the weights
        res["bitwise_equal_to_weights"] = all(torch.equal(v.view(torch.uint8).cpu(), o.view(torch.uint8).cpu())
                                              for v, o in zip(fast, originals))
    res["host_speedup"] = res["per_tensor"]["host_us_per_unit"] / res["batched"]["host_us_per_unit"]
    return res


def _kernels_alone(unit, batched, src: torch.Tensor, dst: torch.Tensor) -> dict:
    """The batched widening's kernel launches alone (no plain copy, no escapes), timed with CUDA
    events over 50 units, and the bytes they read and write per second: against ``bf16_copy_ms``
    (a device copy: the memory's pace), how far each kernel is from the bound."""
    from diffsynth_core.offload import packed_cuda, widen_cuda
    from diffsynth_core.offload.packed import nibble_bytes
    from diffsynth_core.offload.widening import _flat

    def kernels():
        for store, compute, _, table in batched.groups:
            widen_cuda.widen_segments(_flat(src, store), _flat(src, torch.float32), _flat(dst, compute), table)
        for table in batched.packed_groups:
            packed_cuda.unpack_segments(src, _flat(dst, torch.int16), table)
    moved = sum(r.numel * (r.store_dtype.itemsize + r.compute_dtype.itemsize) + r.shape[0] * 4
                for r in unit.tensors if r.quantized)
    moved += sum(r.numel * 3 + nibble_bytes(r.numel) for r in unit.tensors if r.packed)
    kernels()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50
    start.record()
    for _ in range(n):
        kernels()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / n
    return {"kernels_ms": ms, "kernel_bytes": moved, "kernel_gb_per_s": moved / ms / 1e6}


# --- optimizer offload toy -------------------------------------------------------------------------
OPTIM_STEPS, OPTIM_WARMUP = 23, 3


def _adamw_alone(model: nn.Module, device: torch.device, threads: list[int]) -> dict:
    """The fused CPU AdamW step over the whole toy, by intra-op thread count, also while host<->device
    copies of the toy's size run back to back (the memory traffic the offloaded step adds)."""
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    opt.step()
    default = torch.get_num_threads()

    def timed(n: int) -> float:
        torch.set_num_threads(n)
        opt.step()
        t0 = time.perf_counter()
        for _ in range(5):
            opt.step()
        torch.set_num_threads(default)
        return (time.perf_counter() - t0) / 5
    out = {"threads": default, "step_s": timed(default), "by_threads": {n: timed(n) for n in threads}}
    if device.type == "cuda":  # ~0.7 GB each way per copy, 16 of them: longer than the timed steps
        host = torch.empty(sum(p.numel() for p in model.parameters()), pin_memory=True)
        dev = torch.empty_like(host, device=device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            for _ in range(16):
                dev.copy_(host, non_blocking=True)
                host.copy_(dev, non_blocking=True)
        out["under_copies_by_threads"] = {n: timed(n) for n in [default, *threads]}
        out["copies_still_running"] = not stream.query()
        stream.synchronize()
        del host, dev
    out["by_memory"] = {kind: _adamw_in_memory(model, kind) for kind in MEMORY_KINDS
                        if device.type == "cuda" or kind == "regular"}
    out["per_unit_step_s"] = _adamw_in_memory(model, "regular", per_unit=True)
    out["foreach_step_s"] = _adamw_in_memory(model, "regular", foreach=True)
    return out


# Where the weights and gradients AdamW streams live: torch.empty memory, an offload arena
# page-locked in place (cudaHostRegister), cudaHostAlloc'd memory.
MEMORY_KINDS = ("regular", "arena_pinned", "cuda_host_alloc")


def _adamw_in_memory(model: nn.Module, kind: str, per_unit: bool = False, foreach: bool = False) -> float:
    from diffsynth_core.offload.arena import HostArena

    params = [p.detach() for p in model.parameters()]
    if kind == "regular":
        weights, grads, arenas = [p.clone() for p in params], [torch.randn_like(p) for p in params], []
    else:
        numel = sum(p.numel() for p in params)
        arenas = [HostArena(numel * 4) for _ in range(2)]
        views: list[list[torch.Tensor]] = [[], []]
        for arena, out in zip(arenas, views):
            if kind == "cuda_host_alloc":
                arena.buffer = torch.empty(numel * 4, dtype=torch.uint8, pin_memory=True)
            flat, off = arena.buffer.view(torch.float32), 0
            for p in params:
                out.append(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            if kind == "arena_pinned":
                arena.pin()
        weights, grads = views
        for w, g, p in zip(weights, grads, params):
            w.copy_(p)
            g.normal_()
    stand_ins = [nn.Parameter(w) for w in weights]
    for s, g in zip(stand_ins, grads):
        s.grad = g
    groups = [stand_ins[i:i + 2] for i in range(0, len(stand_ins), 2)] if per_unit else [stand_ins]
    opts = [torch.optim.AdamW(g, lr=1e-5, **({"foreach": True} if foreach else {"fused": True})) for g in groups]
    for opt in opts:
        opt.step()
    t0 = time.perf_counter()
    for _ in range(5):
        for opt in opts:
            opt.step()
    elapsed = (time.perf_counter() - t0) / 5
    for arena in arenas:
        arena.release()
    return elapsed


def optim_worker(a) -> dict:
    from diffsynth_core.offload import OffloadTrainingManager

    cuda = torch.device(a.device)
    on_gpu = cuda.type == "cuda"
    width, batch = (1024, 128) if a.quick else (4096, 512)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(10)])
    x = torch.randn(batch, width, device=cuda)
    if a.mode == "cpu_adamw_alone":
        n = torch.get_num_threads()
        return _adamw_alone(model, cuda, sorted({max(1, n - k) for k in (1, 2, 4)} | {max(1, n // 2)}, reverse=True))
    mgr = pager = None
    if a.mode in ("all_gpu", "gpu_step_in_backward"):
        model.to(cuda)
    else:
        with warnings.catch_warnings():  # a budget over blocks stepped on the host says it keeps none resident
            warnings.simplefilter("ignore")
            mgr = OffloadTrainingManager(model, cuda, enable_optimizer_cpu_offload=True, prefetch=a.prefetch,
                                         vram_budget_gb=a.budget_gib)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if a.mode == "gpu_step_in_backward":
        # The other way to take AdamW's state off the GPU: the step stays on the GPU, each weight's
        # moments are paged in from host memory during backward (StepInBackward) and out again; the
        # weights stay resident, so this keeps more on the GPU than optimizer offload does.
        from diffsynth_core.offload.backward_steps import StepInBackward

        pager = StepInBackward(opt)
    if a.mode.startswith("bound"):
        threads = None if a.threads_less is None else max(1, torch.get_num_threads() - a.threads_less)
        mgr.bind_optimizer(opt, overlap_backward=a.mode.startswith("bound_overlap_backward"), threads=threads,
                           device_step_share=a.device_share, keep_device_state=a.keep_device_state)
    start = trace = None
    for i in range(OPTIM_STEPS):  # the period of the steps after warm-up, every host step and kernel drained at the end
        if i == OPTIM_WARMUP:
            if on_gpu:
                torch.cuda.synchronize()
            if mgr is not None and mgr.stepper is not None:
                mgr.stepper.join()
                before = dict(mgr.stepper.stats)
            start, phases = time.perf_counter(), {"forward": 0.0, "backward": 0.0, "optimizer_step": 0.0}
            h2d_before = mgr.report()["h2d_bytes"] if mgr is not None else 0
        if i == OPTIM_STEPS - 2 and mgr is not None and mgr.stepper is not None:
            trace = mgr.stepper.trace = []  # the last two steps, for the timeline
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        t1 = time.perf_counter()
        loss.backward()
        if mgr is not None:
            mgr.after_backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if start is not None:  # the main thread's time per phase (it waits for the GPU only at the end)
            for key, dt in zip(phases, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
                phases[key] += dt
            if trace is not None:
                trace += [("main_forward", -1, t0, t1), ("main_backward", -1, t1, t2)]
    if mgr is not None and mgr.stepper is not None:
        mgr.stepper.join()
    if on_gpu:
        torch.cuda.synchronize()
    steps = OPTIM_STEPS - OPTIM_WARMUP
    out = {"step_s": (time.perf_counter() - start) / steps,
           "gpu_peak_gb": torch.cuda.max_memory_allocated() / GB if on_gpu else None,
           **{f"main_{k}_s_per_step": v / steps for k, v in phases.items()}}
    if mgr is not None and mgr.device_steps is not None:  # whole run, warm-up included
        out["device_steps"] = dict(mgr.device_steps.stats, units=sorted(mgr.device_steps.units))
    if mgr is not None and mgr.stepper is not None:  # where the step's time went, per step
        st = mgr.stepper.stats
        out.update(host_threads=mgr.stepper.threads, host_adamw_s_per_step=(st["step_s"] - before["step_s"]) / steps,
                   forward_waited_s_per_step=(st["waited_s"] - before["waited_s"]) / steps)
    if trace:  # milliseconds from the first mark
        t_first = min(t[2] for t in trace)
        out["timeline_ms"] = [[what, unit, round((t0 - t_first) * 1e3, 2), round((t1 - t_first) * 1e3, 2)]
                              for what, unit, t0, t1 in sorted(trace, key=lambda t: t[2])]
    if mgr is not None:
        report = mgr.report()
        out.update(stalls=report["stalls"], slots=report["slots"],
                   weights_h2d_gb_per_step=(report["h2d_bytes"] - h2d_before) / steps / GB)
        mgr.detach()
    if pager is not None:
        # every step but the first, which makes the state, copies it all in
        out["state_h2d_gb_per_step"] = pager.stats["h2d_bytes"] / (OPTIM_STEPS - 1) / GB
        out["late_copies_in"] = pager.stats["late_copies_in"]
        pager.remove()
    return out


OPTIM_ROWS = {  # row -> (mode, extra worker args)
    "all_gpu": ("all_gpu", []),
    "cpu_adamw_alone": ("cpu_adamw_alone", []),
    "unbound": ("unbound", []),
    "bound": ("bound", []),
    "bound_overlap_backward": ("bound_overlap_backward", []),
    # diagnostic: the worker with every intra-op thread (the default leaves two)
    "bound_overlap_backward_all_threads": ("bound_overlap_backward", ["--threads-less", "0"]),
    # not optimizer offload: AdamW on the GPU, its state paged in from the host during backward
    "gpu_step_in_backward": ("gpu_step_in_backward", []),
    # the first units' steps on the GPU during backward, their state paged through the host
    # (bind_optimizer(device_step_share=...)): the worker steps the rest
    **{f"bound_overlap_backward_device_{int(share * 100)}": ("bound_overlap_backward", ["--device-share", str(share)])
       for share in (0.2, 0.3, 0.4, 0.5)},
    # every unit in its own slot (prefetch 9): a unit loaded for the forward is still there for its
    # backward, so the weights cross PCIe once a step instead of twice
    "bound_overlap_backward_held": ("bound_overlap_backward", ["--prefetch", "9"]),
    **{f"bound_overlap_backward_device_{int(share * 100)}_held": ("bound_overlap_backward",
                                                                  ["--device-share", str(share), "--prefetch", "9"])
       for share in (0.1, 0.2, 0.3)},
    # the GPU's share keeps its AdamW state on the GPU between steps (keep_device_state): only its
    # weights cross PCIe, in and out; its state's bytes stay on the GPU
    **{f"bound_overlap_backward_device_{int(share * 100)}_kept{held}": (
        "bound_overlap_backward", ["--device-share", str(share), "--keep-device-state",
                                   *(["--prefetch", "9"] if held else [])])
       for share in (0.2, 0.3, 0.5) for held in ("", "_held")},
    # a GPU memory budget instead of prefetch 9: the planner turns what it leaves into slots
    **{f"bound_overlap_backward{dev}_budget_{gib}gib": (
        "bound_overlap_backward", [*(["--device-share", "0.5", "--keep-device-state"] if dev else []),
                                   "--budget-gib", str(gib)])
       for dev, gib in (("", 1.2), ("_device_50_kept", 2.0), ("_device_50_kept", 2.4))},
}


def case_optim(a) -> dict:
    picked = a.optim_rows.split(",") if a.optim_rows else list(OPTIM_ROWS)
    unknown = [row for row in picked if row not in OPTIM_ROWS]
    if unknown:
        raise SystemExit(f"bench.offload: unknown --optim-rows {', '.join(unknown)}; rows: {', '.join(OPTIM_ROWS)}")
    rows = {row: OPTIM_ROWS[row] for row in picked}
    rows = {"all_gpu": OPTIM_ROWS["all_gpu"], "cpu_adamw_alone": OPTIM_ROWS["cpu_adamw_alone"], **rows}
    res = {row: _spawn(["--worker", "optim", "--mode", mode, *extra], 200) for row, (mode, extra) in rows.items()}
    if all("step_s" in res[row] for row in ("all_gpu", "cpu_adamw_alone")):  # a failed row leaves the rest
        floor = max(res["all_gpu"]["step_s"], res["cpu_adamw_alone"]["step_s"])
        for row in rows:
            if row not in ("all_gpu", "cpu_adamw_alone") and "step_s" in res[row]:
                res[row]["step_over_max_gpu_or_cpu_adamw"] = res[row]["step_s"] / floor
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="optim,qwen20b,fp8_loss,determinism")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the bench runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", default=None, help="block counts of the DiT, one per depth key of --layout (8,48)")
    ap.add_argument("--layout", default="qwen_image", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    ap.add_argument("--flux2-rows", default=",".join(FLUX2_DEFAULT_ROWS),
                    help="flux2 rows: <dev|klein9b|klein4b>_ + resident_compiled, budget_<GB>gb_compiled, "
                         "packed_budget_<GB>gb[_act]_compiled, fp8_budget_<GB>gb_compiled (24 GB for dev, 16 klein)")
    ap.add_argument("--flux2-dev-layers", default=None,
                    help="FLUX.2-dev's (double, single) blocks for its rows, e.g. 4,24 where 8,48 cannot run resident")
    for flag, kind in (("--height", int), ("--steps", int), ("--warmup", int),
                       ("--save-steps", int), ("--prefetch", int), ("--text-len", int), ("--threads-less", int),
                       ("--profile-step", int)):
        ap.add_argument(flag, type=kind, default={"--text-len": 512, "--prefetch": 1, "--save-steps": 0,
                                                  "--profile-step": 0}.get(flag))
    ap.add_argument("--fp8-loss-layout", default="qwen_image", choices=sorted(FP8_LOSS_LAYOUTS),
                    help="fp8_loss: Qwen-Image (8 blocks) or FLUX.2-dev (whole)")
    ap.add_argument("--fp8-loss-rows", default="bf16_storage,fp8_storage", help="fp8_loss: the rows this run makes")
    ap.add_argument("--fp8-loss-against", default="", help="fp8_loss: an earlier run's JSON holding the other row")
    ap.add_argument("--qwen-steps", type=int, default=12, help="steps of each qwen20b row (3 of warm-up)")
    ap.add_argument("--budget-gib", type=float, default=0.0)
    ap.add_argument("--optim-rows", default="", help="optim rows beside all_gpu and cpu_adamw_alone (default: all)")
    ap.add_argument("--device-share", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--storage", default="")
    ap.add_argument("--mode", default="")
    ap.add_argument("--out-dir", default="")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="with --profile-step: keep each row's profiled step there (NAME.json.gz: device "
                         "events, CUDA runtime calls, host operators of 50 us or more)")
    ap.add_argument("--row-name", default="row", help=argparse.SUPPRESS)
    ap.add_argument("--lora-file", default="")
    ap.add_argument("--qwen-rows", default="budget_24gb,fp8_budget_16gb",
                    help="qwen20b rows beside resident; also fp8_budget_16gb_act (block inputs offloaded), "
                         "fp8_budget_16gb_prefetch2 (three slots), fp8_budget_16gb_pertensor (fp8 widened with a "
                         "launch per tensor, as before widening.py), budget_24gb_act (block inputs offloaded), "
                         "fp8_budget_24gb (fp8 storage within 24 GB); NAME_compiled for resident and the "
                         "budget_24gb[_act] / fp8_budget_24gb / fp8_budget_16gb[_act] rows "
                         "(train.compile_blocks: ratios to resident_compiled); NAME_fused for resident_compiled, "
                         "budget_24gb_compiled, budget_24gb_act_compiled and the fp8_budget_16gb[_act]_compiled "
                         "rows (train.optimizer_args.fused = true); budget_24gb_compiled_fused_hoststate, "
                         "fp8_budget_16gb_compiled_fused_hoststate (offload.optimizer_state_on_host = true); "
                         "resident_narrow, resident_compiled_narrow (train.lora_narrow_inputs = true)")
    for flag in ("--offload", "--deterministic", "--keep-lora", "--act-offload", "--skip-resident",
                 "--per-tensor-widening", "--compile", "--fused-adamw", "--narrow-lora-input", "--state-on-host",
                 "--keep-device-state"):
        ap.add_argument(flag, action="store_true")
    a = ap.parse_args()
    if a.worker in ("qwen", "dit"):
        out = qwen_worker(a)
        lora = out.pop("lora")
        if a.lora_file and lora is not None:
            torch.save(lora, a.lora_file)
        print(json.dumps(out))
        return
    if a.worker == "host_ram":
        print(json.dumps(host_ram_worker(a)))
        return
    if a.worker == "optim":
        print(json.dumps(optim_worker(a)))
        return
    DEVICE[:] = ["--device", a.device]
    QUICK[:] = ["--quick"] if a.quick else []
    cases = {"optim": case_optim, "qwen20b": case_qwen20b, "fp8_loss": case_fp8_loss, "determinism": case_determinism,
             "widen": case_widen, "flux2": case_flux2, "host_ram": case_host_ram}
    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    for name in a.cases.split(","):
        PARTIAL.update(path=a.out, doc=out, case=name)
        t0 = time.perf_counter()
        out[name] = cases[name](a)
        out[name]["wall_s"] = time.perf_counter() - t0
        if a.out:  # written after each case: a later failure loses nothing
            Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
