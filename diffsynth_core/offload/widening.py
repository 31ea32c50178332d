"""One unit's stored bytes (e.g. fp8 codes and scales) widened into its compute layout, in few launches.

Per tensor, a widening is a handful of Python calls and one kernel launch: a real-width Qwen-Image
block holds 32 tensors, so the 120 loads of a 60-block step cost ~3,700 launches, host time the
training step can ill afford: on the H200 the GPU runs only ~1 ms behind the host's launches in a
Qwen-Image step (``gpu_lag_ms`` in ``bench/results/offload_qwen_lag_h200.json`` at 8b1d56c), so host time is
step time.  So a unit is widened in two moves:

* the tensors stored as computed (biases, norm scales) lead both layouts at the same offsets
  (``Unit.layout``): one copy of ``plain_bytes`` lands them all;
* its fp8 tensors of one (storage, compute) dtype pair go through ``widen_cuda.widen_segments``,
  one launch per ``SEGMENTS`` tensors;
* its packed bf16 tensors go through ``packed_cuda.unpack_segments``, one launch per ``SEGMENTS``
  tensors, and one ``index_copy_`` writes back the escaped weights of them all.

Whatever the kernel does not cover (no Triton, a CPU target, another cast) is widened tensor by
tensor, as ``quant.dequantize_rows`` defines it; every path gives the same bits.

Even those few launches cost the host ~0.15-0.3 ms a load in Python (views, Triton's launcher), and
an eager offloaded step is host-bound (``bench/hook_cost.py`` at 8b1d56c).  So a streamer's widening of a unit
(``graphs``; packed and fp8 alike) is recorded as a CUDA graph per (source,
destination) buffer pair, a staging buffer or device copy into a slot, which are the same few
buffers all run long, and replayed from then on: one call.
The first run is eager (it compiles the kernels and shows they all apply: only then is one
recorded); the graph reads the buffers at their addresses, whatever they hold when it replays.
"""

from __future__ import annotations

import warnings

import torch

from . import packed, packed_cuda, widen_cuda
from .arena import typed_view
from .plan import decode_packed, escape_views
from .quant import dequantize_rows
from .units import TensorRecord, Unit

SEGMENTS = 64  # tensors per batched launch (the kernel's table grows with it)
GRAPHS = True  # False: streamers' widenings are never recorded as CUDA graphs (bench/hook_cost.py at 8b1d56c compared)
_SEEN = object()  # a (source, destination) pair widened once, eagerly, by kernels alone
_graphs_failed: list[str] = []  # why recording failed once: from then on nothing is recorded


class UnitWidening:
    """How one unit's stored bytes become its compute layout: planned once, run at every load."""

    def __init__(self, unit: Unit, device: torch.device, graphs: bool = False):
        """``graphs``: record and replay CUDA graphs (a streamer's, whose widenings run on a side
        stream: a graph cannot be recorded on the default one)."""
        self.unit = unit
        self.graphs: dict[tuple[int, int], object] | None = {} if graphs and device.type == "cuda" else None
        self.plain = sum(not rec.needs_cast for rec in unit.tensors)  # they lead (Unit.layout)
        self.groups: list[tuple[torch.dtype, torch.dtype, set[int], tuple]] = []
        self.packed_groups: list[tuple] = []  # tables of ``packed_cuda.unpack_segments``
        if device.type == "cuda":
            self._plan_batches(device)

    def _plan_batches(self, device: torch.device) -> None:
        by_dtypes: dict[tuple, list[TensorRecord]] = {}
        for rec in self.unit.tensors[self.plain:]:
            if rec.quantized:
                by_dtypes.setdefault((rec.store_dtype, rec.compute_dtype), []).append(rec)
        for (store, compute), recs in by_dtypes.items():
            for i in range(0, len(recs), SEGMENTS):
                chunk = recs[i:i + SEGMENTS]
                segments = [(r.host_offset // store.itemsize, r.scale_offset // 4, r.dev_offset // compute.itemsize,
                             r.shape[0], r.numel // r.shape[0]) for r in chunk]
                table = widen_cuda.segment_table(segments, device)
                self.groups.append((store, compute, {id(r) for r in chunk}, table))
        recs = [rec for rec in self.unit.tensors[self.plain:] if rec.packed]
        for i in range(0, len(recs), SEGMENTS):
            segments = [(r.host_offset, r.nibble_offset, r.dev_offset // 2, r.numel, r.packed_base)
                        for r in recs[i:i + SEGMENTS]]
            self.packed_groups.append(packed_cuda.segment_table(segments, device))

    def run(self, src: torch.Tensor, dst: torch.Tensor, views: list[torch.Tensor]) -> None:
        """Widen from ``src`` (uint8, the unit's stored layout from its start) into ``dst`` (uint8, the
        compute layout from its start), whose per-tensor views are ``views``."""
        if self.graphs is None or not GRAPHS or _graphs_failed:
            self._launch(src, dst, views)
            return
        key = (src.data_ptr(), dst.data_ptr())
        graph = self.graphs.get(key)
        if graph is _SEEN:
            graph = self.graphs[key] = self._record(src, dst, views)
        if graph is None:  # first time, or not recordable: eagerly
            if self._launch(src, dst, views):
                self.graphs[key] = _SEEN
            return
        graph.replay()

    def _record(self, src: torch.Tensor, dst: torch.Tensor, views: list[torch.Tensor]):
        """The widening of ``src`` into ``dst`` recorded as a CUDA graph on the current stream (nothing
        runs yet); ``None`` if recording fails, after which nothing is recorded again."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads (the loop's batch prefetch) may use CUDA meanwhile
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._launch(src, dst, views)
            finally:
                graph.capture_end()
        except Exception as err:  # noqa: BLE001 - the eager widening is always there
            _graphs_failed.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"offload: recording the widening as a CUDA graph failed ({type(err).__name__}); "
                          "widening eagerly from now on", RuntimeWarning, stacklevel=2)
            return None
        return graph

    def _launch(self, src: torch.Tensor, dst: torch.Tensor, views: list[torch.Tensor]) -> bool:
        """The widening, launched; whether kernels widened every tensor (no tensor by tensor)."""
        plain_bytes = self.unit.plain_bytes
        if plain_bytes:
            dst.narrow(0, 0, plain_bytes).copy_(src.narrow(0, 0, plain_bytes))
        done: set[int] = set()
        for store, compute, ids, table in self.groups:
            if widen_cuda.widen_segments(_flat(src, store), _flat(src, torch.float32), _flat(dst, compute), table):
                done |= ids
        if self.packed_groups and all([packed_cuda.unpack_segments(src, _flat(dst, torch.int16), table)
                                       for table in self.packed_groups]):
            packed.patch(_flat(dst, torch.int16), *escape_views(src, self.unit, start=0))
            done |= {id(rec) for rec in self.unit.tensors if rec.packed}
        by_kernels = True
        for rec, view in zip(self.unit.tensors[self.plain:], views[self.plain:]):
            if id(rec) not in done:
                widen_one(self.unit, rec, src, view)
                by_kernels = False
        return by_kernels


def _flat(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` (uint8) seen as one flat tensor of ``dtype`` (its whole elements)."""
    return buf.narrow(0, 0, buf.numel() // dtype.itemsize * dtype.itemsize).view(dtype)


def widen_each(unit: Unit, src: torch.Tensor, views: list[torch.Tensor]) -> None:
    """The whole unit tensor by tensor: the reference the batched moves must equal (and what the
    engine did before them; ``bench.offload``'s ``_pertensor`` rows)."""
    for rec, view in zip(unit.tensors, views):
        widen_one(unit, rec, src, view)


def widen_one(unit: Unit, rec: TensorRecord, src: torch.Tensor, view: torch.Tensor) -> None:
    """Widen one tensor of ``unit`` from its stored bytes in ``src`` (the unit's region) into ``view``."""
    stored = typed_view(src, rec.host_offset, rec.store_dtype, rec.shape)
    if rec.quantized:
        scales = typed_view(src, rec.scale_offset, torch.float32, torch.Size([rec.shape[0]]))
        dequantize_rows(stored, scales, rec.compute_dtype, out=view)
    elif rec.packed:
        decode_packed(src, unit, rec, start=0, out=view)
    else:
        view.copy_(stored)
