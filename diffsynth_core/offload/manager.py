"""``OffloadTrainingManager``: train (or run) a model whose weights live in host memory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from .arena import HostArena
from .shared_arena import SharedHostArena, shared_host_arena
from .grads import GradAverager, HostGradSink
from .plan import Plan, build_plan
from .schedule import SuccessorSchedule
from .streamer import Streamer

_MARK = "_splitflow_offload_manager"


class OffloadTrainingManager:
    """Streams a model's weights from host memory to ``target_device`` as the model runs.

    **Units.** With ``granularity="block"`` every child of the model's ModuleLists of blocks
    (``block_container_names``, auto-detected when ``None``) is one unit; ``"leaf"`` makes every
    parameter-owning leaf module a unit.  A unit's frozen weights sit in one 64-byte aligned region of
    a single host arena (page-locked with ``cudaHostRegister`` when ``pin_memory`` is on; ``None`` =
    on exactly when the target is CUDA) and reach the device as **one copy per unit** on a side
    stream, into one of ``prefetch + 1`` reused device slots.  The next ``prefetch`` units in
    execution order (learned on the first step: forward order, then reverse order in backward,
    recompute included) are copied while the current one computes.  Eviction only points the
    parameters back at their host copy: frozen weights never travel device->host.
    ``vram_budget_gb`` keeps that many GiB of units permanently on the device, spread evenly over
    the execution order.  ``storage_dtype`` (e.g. ``torch.float8_e4m3fn``) stores frozen floating
    weights in that dtype on the host and widens them on the device (lossy; ``detach`` gives back
    the widened values).  Everything else (buffers, parameters shared between units or owned by
    non-leaf modules outside the units, e.g. Wan's ``scale_shift_table``) is moved to the device once.

    **Order of set-up** (what ``training.prepare`` does): apply LoRA (peft) first, so the adapter
    weights exist and are trainable; then ``apply_gradient_checkpointing``; then attach this
    manager; then build the optimizer over ``[p for p in model.parameters() if p.requires_grad]``.
    Building the optimizer before attaching also works (parameters keep their identity; only their
    ``.data`` moves), provided it has taken no step yet.  Mark parameters trainable/frozen before
    attaching: that split is read once, at attach.

    **Where trainable parameters live.**  Without optimizer offload (LoRA): on ``target_device``,
    permanently, in their own dtype (peft keeps adapters in fp32 by default even on a bf16 base),
    with their gradients and the optimizer state there too.  With
    ``enable_optimizer_cpu_offload=True`` (full fine-tuning): trainable weights inside units live in
    the host arena, are streamed with their unit, their gradients are copied to the host as they are
    produced, and after ``after_backward()`` both weights and gradients are host tensors, so the
    optimizer steps on the CPU (use ``torch.optim.AdamW(..., fused=True)``).  Trainable parameters
    outside units stay on the device.

    **Training step**: ``loss.backward(); mgr.after_backward(); optimizer.step();
    optimizer.zero_grad(set_to_none=True)``.  Call ``after_backward()`` after every backward
    (gradient accumulation works: gradients add up as usual).  It evicts every streamed unit,
    finishes gradient copies and, when ``torch.distributed`` runs with several ranks, averages the
    trainable gradients over ranks.  Inference under ``torch.no_grad()`` works while attached.
    ``detach()`` removes every hook and gives back the model with real weights on their original
    devices.  ``cpu_offload_split_threshold`` (MB, reference API) switches to ``"leaf"`` units.

    Other options: ``trainable_dtype=torch.float32`` upcasts device-resident trainable parameters
    (LoRA adapters injected into a bf16 base) at attach; they stay in that dtype after ``detach``
    (peft casts the adapter input, so the forward keeps working).  ``data_parallel`` (``None`` =
    on when torch.distributed has several ranks) broadcasts rank 0's trainable weights at attach and
    averages gradients in ``after_backward``.  ``poison_evicted`` (debug) fills a slot with garbage
    after each eviction, so a stale reference to evicted weights shows up as NaN.
    ``share_host_copy`` (``None`` = on when torch.distributed has several ranks): the ranks of one
    machine share one host copy of the frozen weights (``shared_arena.py``), so host RAM does not
    grow with the number of GPUs; not with optimizer offload (each rank's optimizer owns its copy).

    Telemetry: ``report()`` (units, bytes, H2D copies and bytes, per-phase loads, ``stalls`` = uses
    whose copy had not landed yet) and ``loaded_units()``.  After inference, ``after_backward()``
    also frees the device slots' contents.  Do not ``.to()`` the model while attached.
    """

    def __init__(self, model: nn.Module, target_device, enable_optimizer_cpu_offload: bool = False,
                 cpu_offload_split_threshold: float | None = None, *, block_container_names=None,
                 granularity: str = "block", prefetch: int = 1, vram_budget_gb: float = 0.0,
                 storage_dtype: torch.dtype | None = None, pin_memory: bool | None = None,
                 trainable_dtype: torch.dtype | None = None, data_parallel: bool | None = None,
                 poison_evicted: bool = False, share_host_copy: bool | None = None):
        if getattr(model, _MARK, None) is not None:
            raise RuntimeError("an OffloadTrainingManager is already attached to this model; detach() it first")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if vram_budget_gb < 0:
            raise ValueError(f"vram_budget_gb must be >= 0, got {vram_budget_gb}")
        if cpu_offload_split_threshold is not None:
            granularity = "leaf"
        self.model, self.device = model, torch.device(target_device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch = prefetch
        self.optimizer_offload = enable_optimizer_cpu_offload
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.plan: Plan = build_plan(model, self.device, granularity, block_container_names,
                                     enable_optimizer_cpu_offload, storage_dtype, vram_budget_gb,
                                     trainable_dtype)
        self.plan.move_resident()
        self.arena = self._make_arena(pin, share_host_copy)
        n_slots = min(prefetch + 1, len(self.plan.streamed))
        self.streamer = Streamer(self.plan.streamed, self.arena, self.device, n_slots, poison_evicted)
        self.plan.load_budget_units(self.arena)
        self.sched = SuccessorSchedule()
        if self.plan.blocks:  # blocks run in list order: prefetch from the very first step
            self.sched.seed([u.index for u in self.plan.units])
        self._streamed_ids = {u.index for u in self.plan.streamed}
        self._order: list[int] = []  # streamed units in the order their forward first ran this step
        self._order_seen: set[int] = set()
        self._by_index = {u.index: u for u in self.plan.units}
        self.grad_sink = (HostGradSink(self.plan.host_trainable, self.device, pin)
                          if self.plan.host_trainable else None)
        self.averager = self._make_averager(data_parallel)
        self._handles = self._register_hooks()
        self.stats = {"loads": {"F": 0, "B": 0}, "max_loaded": 0, "steps": 0}
        self.unit_loads: dict[int, dict[str, int]] = {u.index: {"F": 0, "B": 0} for u in self.plan.units}
        setattr(model, _MARK, self)

    # --- set-up helpers ------------------------------------------------------------------------
    def _make_arena(self, pin: bool, share: bool | None) -> HostArena:
        """The filled host arena: one per machine shared by its local ranks (shared_arena.py), or our own."""
        if share is not False:
            arena = shared_host_arena(self.plan, pin)
            if arena is not None:
                return arena
        arena = HostArena(self.plan.arena_bytes, pin)
        self.plan.fill_arena(arena)
        return arena

    def _make_averager(self, data_parallel: bool | None) -> GradAverager | None:
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if data_parallel is None:
            data_parallel = multi
        if not data_parallel:
            return None
        if not multi:
            raise RuntimeError("data_parallel=True needs an initialised torch.distributed group of several ranks")
        params = [p for p in self.model.parameters() if p.requires_grad]
        averager = GradAverager(params)
        averager.broadcast_params()  # every rank starts from rank 0's trainable weights
        return averager

    def _register_hooks(self) -> list:
        handles = []
        for unit in self.plan.units:
            handles.append(unit.module.register_forward_pre_hook(self._pre_hook(unit)))
            handles.append(unit.module.register_forward_hook(self._post_hook(unit), with_kwargs=True))
        return handles

    def _pre_hook(self, unit):
        def hook(module, args):
            self._use(unit, "R" if torch._C._current_graph_task_id() != -1 else "F")
        return hook

    def _post_hook(self, unit):
        def hook(module, args, kwargs, output):
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return  # inference, or a recompute inside backward: no backward of its own
            inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            outs = [t for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in inputs]
            if outs:  # the unit's backward starts when the first of its outputs gets a gradient
                torch.autograd.graph.register_multi_grad_hook(outs, lambda grads: self._use(unit, "B"), mode="any")
        return hook

    # --- the one scheduling decision ---------------------------------------------------------------
    def _use(self, unit, phase: str) -> None:
        """``unit`` is about to compute: make sure it is (being) loaded, prefetch what follows."""
        key = (unit.index, phase)
        self.sched.observe(key)
        window = self.sched.window(key, self.prefetch, self._streamed_ids)
        keep = {unit.index} | {k[0] for k in window}
        streamer = self.streamer
        if unit.index in self._streamed_ids:
            if phase == "F" and unit.index not in self._order_seen:
                self._order_seen.add(unit.index)
                self._order.append(unit.index)
            if not streamer.is_loaded(unit):
                self._load(unit, phase, streamer.home_slot(unit))
            streamer.wait_ready(unit)
        for k in window:  # prefetch, unless the home slot holds a unit still needed sooner
            nxt = self._by_index[k[0]]
            if not streamer.is_loaded(nxt):
                slot = streamer.home_slot(nxt, keep)
                if slot is not None:
                    self._load(nxt, k[1], slot)
        self.stats["max_loaded"] = max(self.stats["max_loaded"], len(streamer.slot_of))

    def _load(self, unit, phase: str, slot) -> None:
        self.streamer.load(unit, slot, self._hide_grads if self.grad_sink else None)
        p = "F" if phase == "F" else "B"
        self.stats["loads"][p] += 1
        self.unit_loads[unit.index][p] += 1

    def _hide_grads(self, unit) -> None:
        for rec in unit.tensors:
            if rec.trainable:
                self.grad_sink.hide(rec.param)

    # --- public verbs ------------------------------------------------------------------------------
    def after_backward(self) -> None:
        """Evict every streamed unit, land host gradients, average gradients over ranks."""
        self._check_attached()
        self._release()
        if self.averager is not None:
            self.averager.average()
        self.stats["steps"] += 1

    def detach(self) -> nn.Module:
        """Remove every hook and give the model back: real weights on their original devices."""
        self._check_attached()
        self._release()
        for h in self._handles:
            h.remove()
        if self.grad_sink is not None:
            self.grad_sink.remove()
        self.plan.restore(self.streamer)
        if self.streamer.cuda:  # no copy may still read the host memory we are about to free
            torch.cuda.synchronize(self.device)
        self.arena.release()
        if self.grad_sink is not None:
            self.grad_sink.arena.release()
        self.streamer = None
        delattr(self.model, _MARK)
        return self.model

    def _release(self) -> None:
        self.streamer.evict_all()
        if self.grad_sink is not None and self.streamer.cuda:
            self.streamer.copy_stream.synchronize()  # the optimizer is about to rewrite host weights
        self.sched.end_step()
        if self._order:  # homes follow the execution order, so a window never shares a slot
            rest = [u.index for u in self.plan.streamed if u.index not in self._order_seen]
            self.streamer.rehome(self._order + rest)
            self._order, self._order_seen = [], set()
        if self.grad_sink is not None:
            self.grad_sink.finish()

    def loaded_units(self) -> list[str]:
        """Names of the streamed units whose weights are on the device right now."""
        return [u.name for u in self.streamer.loaded_units()]

    def report(self) -> dict:
        """Sizes and traffic, for logs and tests."""
        return {"units": len(self.plan.units), "streamed_units": len(self.plan.streamed),
                "budget_units": len(self.plan.units) - len(self.plan.streamed),
                "streamed_bytes": sum(u.host_bytes for u in self.plan.streamed),
                "arena_bytes": self.arena.nbytes, "pinned": self.arena.pinned,
                "arena_shared": isinstance(self.arena, SharedHostArena),
                "slots": len(self.streamer.slots) if self.streamer else 0,
                "h2d_copies": self.streamer.copies if self.streamer else 0,
                "h2d_bytes": self.streamer.bytes if self.streamer else 0,
                "stalls": self.streamer.stalls if self.streamer else 0,
                "d2h_grad_bytes": self.grad_sink.d2h_bytes if self.grad_sink else 0, **self.stats}

    def _check_attached(self) -> None:
        if self.streamer is None:
            raise RuntimeError("this OffloadTrainingManager was detached")
