"""``OffloadTrainingManager``: train (or run) a model whose weights live in host memory."""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as dist
import torch.optim.optimizer as optim_hooks
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import InputError
from .arena import HostArena, release_all
from .shared_arena import SharedHostArena, shared_host_arena
from .budget import (GIB, BudgetTracker, auto_budget, forward_order, plan_residency, static_residency,
                     unstepped_state_bytes)
from .grads import GradAverager, HostGradSink, blocking_event
from .device_steps import DeviceSteps
from .host_optimizer import HostStepper
from .plan import MIB, Plan, build_plan
from .packed import PACKED
from .schedule import SuccessorSchedule
from .streamer import Streamer
from .units import find_blocks, module_bytes

_MARK = "_splitflow_offload_manager"


class OffloadTrainingManager:
    """Streams a model's weights from host memory to ``target_device`` as the model runs.

    **Units.** With ``granularity="block"`` every child of the model's ModuleLists of blocks
    (``block_container_names``, auto-detected when ``None``) is one unit; ``"leaf"`` makes every
    parameter-owning leaf module a unit.  ``cpu_offload_split_threshold`` (MB, as in the reference
    API) splits every unit whose weights exceed that many bytes into its children, recursively
    (smaller units: smaller slots, more copies).  Every unit's frozen weights sit in one 64-byte
    aligned region of a single host arena (made by ``host_arena_factory``, default
    :class:`~.arena.HostArena`; page-locked with ``cudaHostRegister`` when ``pin_memory`` is on,
    ``None`` = on exactly when the target is CUDA) and reach the device as **one copy per unit** on
    a side stream, into one of ``prefetch + 1`` reused device slots.  ``share_host_copy`` (``None`` =
    on when torch.distributed has several ranks): the ranks of one machine share one host copy of
    the frozen weights (``shared_arena.py``), so host RAM does not grow with the number of GPUs; not
    with optimizer offload (each rank's optimizer owns its copy).  The next ``prefetch`` units in
    execution order (learned on the first step: forward order, then reverse order in backward,
    recompute included) are copied while the current one computes.  Eviction only points the
    parameters back at their host copy: frozen weights never travel device->host, and frozen units
    still in the slots when a step ends stay there for the next step's forward.

    **GPU memory budget.** ``vram_budget_gb`` (GiB, or ``"auto"`` = what the device has free minus
    5 % of it; ``0`` = stream every unit) caps the step's peak device memory.  The first step runs
    with every unit streamed and is measured; at the start of the second, the units whose residency
    saves the most copied bytes per step fill what the budget leaves (see ``budget``), and the run
    stops with an :class:`~diffsynth_core.errors.InputError` if the step alone does not fit.
    ``report()`` gives planned vs measured bytes per step and the peak.  ``resident_gb`` instead keeps
    that many GiB of units on the device from attach on, evenly spaced, without measuring anything
    (for callers that plan the device memory themselves, e.g. the preprocess stage's encoders).

    ``storage_dtype=torch.float8_e4m3fn`` stores frozen weights of two or more dimensions as fp8
    with one power-of-two scale per row (``quant``): half the host RAM and half the bytes per
    copy; the device widens them to the compute dtype in one pass (``widen_cuda``; lossy: ``detach``
    gives back the widened values).  Under a budget such units are kept on the device as stored
    and widened into a slot at each use (half the device bytes of a widened copy).
    ``storage_dtype="packed_bfloat16"`` keeps such bf16 weights in 12 bits each plus escapes
    (``packed``): ~75 % of the host RAM and of the bytes per copy, decoded on the device to the
    very same bits (lossless), and kept on the device as stored under a budget, like fp8.  Everything
    else (buffers, parameters shared between units or owned by modules outside the units, e.g.
    Wan's ``scale_shift_table``) is moved to the device once.

    **Order of set-up** (what ``training.prepare`` does): apply LoRA (peft) first, so the adapter
    weights exist and are trainable; then ``apply_gradient_checkpointing``; then attach this
    manager; then build the optimizer over ``[p for p in model.parameters() if p.requires_grad]``.
    Mark parameters trainable/frozen before attaching: that split is read once, at attach.

    **Where trainable parameters live.**  Without optimizer offload (LoRA): on ``target_device``,
    permanently, in their own dtype (``trainable_dtype=torch.float32`` upcasts them at attach).
    With ``enable_optimizer_cpu_offload=True`` (full fine-tuning): trainable weights inside units
    live in the host arena, are streamed with their unit, their gradients are copied to the host as
    they are produced, and after ``after_backward()`` both weights and gradients are host tensors,
    so the optimizer steps on the CPU (``torch.optim.AdamW(..., fused=True)``).
    ``bind_optimizer(optimizer)`` moves that CPU step off the critical path (see there).

    **Training step**: ``loss.backward(); mgr.after_backward(); optimizer.step();
    optimizer.zero_grad(set_to_none=True)``.  ``after_backward()`` after every backward (gradient
    accumulation works) lands host gradients and, with several ``torch.distributed`` ranks
    (``data_parallel``), averages the trainable gradients.  ``optimizer.step()`` before
    ``after_backward()`` raises.  ``detach()`` removes every hook and gives the model back in
    place (weights stored unchanged keep the arena's memory: no second host copy);
    ``detach(restore_frozen=False)`` releases the frozen weights instead (meta tensors), for when
    only the trainable ones are needed (a LoRA export).  ``poison_evicted`` (debug) fills a slot
    with garbage after each eviction.  Telemetry: ``report()`` and ``loaded_units()``.  Do not
    ``.to()`` the model while attached.
    """

    def __init__(self, model: nn.Module, target_device, enable_optimizer_cpu_offload: bool = False,
                 cpu_offload_split_threshold: float | None = None, *, block_container_names=None,
                 granularity: str = "block", prefetch: int = 1, vram_budget_gb: float | str = 0.0,
                 storage_dtype: torch.dtype | str | None = None, pin_memory: bool | None = None,
                 trainable_dtype: torch.dtype | None = None, data_parallel: bool | None = None,
                 poison_evicted: bool = False, host_arena_factory=None, share_host_copy: bool | None = None,
                 resident_gb: float = 0.0):
        if getattr(model, _MARK, None) is not None:
            raise RuntimeError("an OffloadTrainingManager is already attached to this model; detach() it first")
        _check_options(prefetch, vram_budget_gb, cpu_offload_split_threshold, storage_dtype)
        self.model, self.device = model, torch.device(target_device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch = prefetch
        self.optimizer_offload = enable_optimizer_cpu_offload
        split = None if cpu_offload_split_threshold is None else int(cpu_offload_split_threshold * MIB)
        self.plan: Plan = build_plan(model, self.device, granularity, block_container_names,
                                     enable_optimizer_cpu_offload, storage_dtype, trainable_dtype, split)
        if storage_dtype == PACKED and not any(rec.packed for unit in self.plan.units for rec in unit.tensors):
            dtypes = sorted({str(rec.orig_dtype).removeprefix("torch.") for u in self.plan.units for rec in u.tensors})
            warnings.warn(f"offload.storage_dtype = {PACKED!r} packs frozen bfloat16 weights only; this model's "
                          f"streamed weights are {', '.join(dtypes) or 'none'}, so nothing is packed "
                          "(load the model in bfloat16 to use it)", RuntimeWarning, stacklevel=2)
        budget = auto_budget(self.device) if vram_budget_gb == "auto" else int(float(vram_budget_gb) * GIB)
        n_slots = min(prefetch + 1, len(self.plan.units))
        # Checked before anything moves: a budget that cannot even hold the slots fails here.
        self.budget = BudgetTracker(budget, self.device, self.plan.fixed_bytes(n_slots)) if budget > 0 else None
        if self.budget is not None and self.plan.units and all(u.trainable for u in self.plan.units):
            # Their weights step on the host and come back with each load: a budget can keep none of
            # them resident (budget.py), only buy slots that hold them across the turn.  Said once,
            # not left to be found in the speed.
            warnings.warn("offload: every block holds trainable weights kept on the host "
                          "(enable_optimizer_cpu_offload), so offload.vram_budget_gb keeps none resident: "
                          "every block streams; what the budget leaves holds blocks from their forward to "
                          "their backward (one copy a step instead of two)", RuntimeWarning, stacklevel=2)
        if split is not None and budget > 0:
            _warn_if_slots_hold_less_than_two_blocks(self.plan, model, block_container_names, n_slots)
        self.plan.move_resident()
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.arena = self._make_arena(pin, share_host_copy, host_arena_factory or HostArena)
        self.streamer = Streamer(self.plan.units, self.arena, self.device, n_slots, poison_evicted)
        if resident_gb:
            self.plan.set_budget(static_residency(self.plan.units, int(resident_gb * GIB)), self.streamer)
        self._setup_schedule()
        self.grad_sink = (HostGradSink(self.plan.host_trainable, self.device, self.arena.pinned)
                          if self.plan.host_trainable else None)
        # A manager dropped without detach() (a library user's, a test's) must unpin its arenas: memory
        # freed while still registered makes a later cudaHostRegister of the same addresses fail.
        # Not at exit: the process's end frees it all, and unpinning 40 GB would delay it.
        arenas = [self.arena] + ([self.grad_sink.arena] if self.grad_sink is not None else [])
        weakref.finalize(self, release_all, arenas).atexit = False
        self.stepper: HostStepper | None = None
        self.device_steps: DeviceSteps | None = None
        self._optimizer_hooks: list = []
        self._watched: list[torch.optim.Optimizer] = []  # watch_optimizer's, for the budget's plan
        self._order_hook = (optim_hooks.register_optimizer_step_pre_hook(self._check_step_order)
                            if self.grad_sink else None)
        self.averager = self._make_averager(data_parallel)
        self._handles = self._register_hooks()
        self._drop_hooks(self.plan.budget)
        self._inference_hook = model.register_forward_hook(self._after_inference_forward)
        # demand_loads: uses whose copy had not been started ahead (prefetch found nothing to do for them)
        self.stats = {"loads": {"F": 0, "B": 0}, "demand_loads": 0, "max_loaded": 0, "steps": 0,
                      "last_step_h2d_bytes": 0, "planned_h2d_bytes_per_step": None}
        self.unit_loads: dict[int, dict[str, int]] = {u.index: {"F": 0, "B": 0} for u in self.plan.units}
        setattr(model, _MARK, self)

    # --- set-up helpers ------------------------------------------------------------------------
    def _make_arena(self, pin: bool, share: bool | None, factory):
        """The filled (then pinned) host arena: one per machine shared by its local ranks
        (shared_arena.py), or this process's own from ``factory``."""
        if share is not False:
            arena = shared_host_arena(self.plan, pin)
            if arena is not None:
                return arena
        arena = factory(self.plan.arena_bytes)
        self.plan.fill_arena(arena)
        if pin:
            arena.pin()
        return arena

    def _setup_schedule(self) -> None:
        self.sched = SuccessorSchedule()
        if self.plan.blocks:  # blocks run in list order: prefetch from the very first step
            self.sched.seed([u.index for u in self.plan.units])
        self._set_streamed()
        self._order: list[int] = []  # streamed units in the order their forward first ran this step
        self._order_seen: set[int] = set()
        self._by_index = {u.index: u for u in self.plan.units}
        self._trainable_units = {u.index for u in self.plan.units if u.trainable}
        self._in_step = False
        self._forward_uses: dict[int, int] = {}
        self._uses: list[int] | None = [] if self.budget is not None else None  # recorded in step 1
        self._step_bytes_start = 0

    def _set_streamed(self) -> None:
        """Units that go through the slots, and among them those that cross PCIe each use in
        another dtype (their copies are staged ahead; compact ones are on the device already).
        Units with trainable weights are not staged: a copy staged but not used within the step
        would outlive the optimizer step that rewrites their host weights."""
        self._streamed_ids = {u.index for u in self.plan.streamed}
        compact = {u.index for u in self.plan.compact}
        self._copied_ids = {u.index for u in self.plan.streamed
                            if u.casts and not u.trainable and u.index not in compact}

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

    def _register_hooks(self) -> dict[int, list]:
        return {unit.index: [unit.module.register_forward_pre_hook(self._pre_hook(unit)),
                             unit.module.register_forward_hook(self._post_hook(unit), with_kwargs=True)]
                for unit in self.plan.units}

    def _drop_hooks(self, units) -> None:
        """Resident units need no hooks: their steps cost no Python at all."""
        for unit in units:
            for h in self._handles.pop(unit.index, []):
                h.remove()

    def _after_inference_forward(self, module, args, output) -> None:
        """A forward of the whole model without gradients (stage 1's encoders, validation) is a step of
        its own for the schedule: the next call's uses count from 0 again and so find the order this
        call learned.  Without this, every call after the first met keys never seen and prefetched
        nothing: each block's copy waited for the previous block's compute."""
        if torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        self.sched.end_step()
        self._rehome_by_order()

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
        if not self._in_step:
            self._begin_step()
        if self._uses is not None:
            self._uses.append(unit.index)
        key = self.sched.observe(unit.index, phase)
        window = self.sched.window(key, self.prefetch, self._streamed_ids)
        keep = {unit.index} | {k[0] for k in window}
        streamer = self.streamer
        if phase == "F" and torch.is_grad_enabled():
            self._forward_uses[unit.index] = self._forward_uses.get(unit.index, 0) + 1
        if phase != "F" and self.device_steps is not None:
            self.device_steps.backward_use(unit.index)
        if unit.index in self._streamed_ids:
            if phase == "F" and unit.index not in self._order_seen:
                self._order_seen.add(unit.index)
                self._order.append(unit.index)
            if not streamer.is_loaded(unit):
                self.stats["demand_loads"] += 1
                if self.stepper is not None:  # its weights must have taken the last optimizer step
                    self.stepper.wait(unit.index)
                self._load(unit, phase, streamer.home_slot(unit))
            streamer.wait_ready(unit)
        for k in window:  # prefetch, unless the home slot holds a unit still needed sooner
            nxt = self._by_index[k[0]]
            if not streamer.is_loaded(nxt) and (self.stepper is None or self.stepper.is_done(nxt.index)):
                slot = streamer.home_slot(nxt, keep)
                if slot is not None:
                    self._load(nxt, k[1], slot)
        if self._copied_ids:  # copies of units stored in another dtype run ahead of their slots
            # (frozen units: no optimizer step to wait for; stage_ahead declines once buffers are full)
            for k in self.sched.window(key, len(streamer.stages), self._copied_ids):
                streamer.stage_ahead(self._by_index[k[0]])
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

    # --- steps and the budget ------------------------------------------------------------------------
    def _begin_step(self) -> None:
        self._in_step = True
        self._forward_uses: dict[int, int] = {}  # unit -> forward runs with gradients this step
        self._step_bytes_start = self.streamer.bytes
        if self.budget is None or self._uses is None:
            return
        if self.stats["steps"] == 0:
            self.budget.begin_first_step()
        else:
            self._plan_budget()

    def _plan_budget(self) -> None:
        """Second step starts: fill what the budget leaves with the units that save most bytes."""
        room = self.budget.room(sum(unstepped_state_bytes(o, self.device) for o in self._watched))
        plan = plan_residency(self.plan.units, self._uses, len(self.streamer.slots), room, self.streamer.slot_bytes)
        self.streamer.evict_all()
        self.streamer.add_slots(plan.extra_slots)
        self.plan.set_budget(plan.resident, self.streamer, plan.compact)
        self._set_streamed()
        self.streamer.rehome([i for i in forward_order(self._uses) if i in self._streamed_ids])
        self._order, self._order_seen = [], set()
        self.budget.planned_peak += plan.device_bytes
        self._drop_hooks(plan.resident)
        self.stats["planned_h2d_bytes_per_step"] = plan.planned_bytes
        self._uses = None

    def _end_step(self) -> None:
        self._in_step = False
        self.stats["last_step_h2d_bytes"] = self.streamer.bytes - self._step_bytes_start
        if self.budget is not None:
            self.budget.end_step(first=self.stats["steps"] == 0)
            if self.budget.over_budget_steps == 1 and self.stats["steps"] > 0:
                warnings.warn(f"offload: the step peaked at {self.budget.peak / GIB:.2f} GiB, over "
                              f"offload.vram_budget_gb = {self.budget.budget / GIB:.2f} GiB", RuntimeWarning,
                              stacklevel=3)

    # --- the optimizer -----------------------------------------------------------------------------
    def bind_optimizer(self, optimizer: torch.optim.Optimizer, overlap_backward: bool = False,
                       threads: int | None = None, device_step_share: float = 0.0,
                       keep_device_state: bool = False) -> None:
        """Step the host (optimizer-offloaded) weights unit by unit on a worker thread.

        ``optimizer.step()`` then queues each unit's step and returns: the next forward waits only
        for the unit it is about to load.  With ``overlap_backward=True`` a unit's step starts as
        soon as its gradients are on the host, during backward; that requires every backward to be
        followed by ``after_backward(); optimizer.step()`` with the gradients untouched (no clipping,
        no accumulation, no data parallel, no skipping a NaN/Inf step: it is applied already), and the
        host gradients never appear in ``.grad``.
        ``optimizer.state_dict()`` waits for the queued steps.  ``threads``: the worker's intra-op
        threads (``None``: all of the process's but two, see ``host_optimizer``).
        ``device_step_share`` (with ``overlap_backward``): about that share of the trainable bytes,
        the units the forward runs first, step on the device during backward instead, their state
        paged through host memory (``device_steps``): the worker has that much less to do before
        the next forward, for 4 weights' bytes over PCIe per such unit and its state on the GPU
        while it steps.  ``keep_device_state``: those units' state stays on the device between steps
        instead (its bytes of device memory for good; 2 weights' bytes over PCIe per unit: the
        weights in and out, as a host unit's weights in and gradients out)."""
        if self.grad_sink is None:
            raise ValueError("bind_optimizer needs enable_optimizer_cpu_offload=True and trainable weights in the units")
        if overlap_backward and self.averager is not None:
            raise ValueError("overlap_backward cannot average gradients over ranks first; bind without it")
        if not isinstance(device_step_share, (int, float)) or not 0.0 <= device_step_share <= 1.0 or \
                (device_step_share and not overlap_backward):
            raise ValueError(f"device_step_share must be within [0, 1] and needs overlap_backward=True, "
                             f"got {device_step_share!r}")
        if keep_device_state and not device_step_share:
            raise ValueError("keep_device_state keeps the state of the units stepped on the device: "
                             "it needs device_step_share > 0")
        units = {u.index: [(r.param, m) for r, m in zip(u.tensors, self.streamer.masters[u.index]) if r.trainable]
                 for u in self.plan.units if u.index in self._trainable_units}
        self.stepper = HostStepper(optimizer, units, threads)
        if overlap_backward:
            self.device_steps = self._device_steps(optimizer, units, device_step_share, keep_device_state)
            self.grad_sink.start_steps(self.stepper, {id(p): u for u, ps in self.stepper.reals.items() for p in ps},
                                       lambda unit: self._forward_uses.get(unit, 0) > 1, self.device_steps)
        else:
            self._optimizer_hooks.append(optimizer.register_step_pre_hook(self._queue_host_steps))
        self._optimizer_hooks.append(optimizer.register_state_dict_pre_hook(lambda opt: self.stepper.join()))
        self._optimizer_hooks.append(optimizer.register_load_state_dict_pre_hook(
            lambda opt, state: self.stepper.join()))

    def _device_steps(self, optimizer: torch.optim.Optimizer, units: dict[int, list[tuple[nn.Parameter, torch.Tensor]]],
                      share: float, keep_state: bool = False) -> DeviceSteps | None:
        """Of ``units`` (the worker's: index -> [(trainable weight, its host master)]), those the
        forward runs first, up to ``share`` of the trainable bytes (at least one), step on the device."""
        if share <= 0:
            return None
        sizes = {u: sum(p.nbytes for p, _ in pairs) for u, pairs in units.items()}
        order = [u.index for u in self.plan.units]  # blocks run in list order (the schedule's seed)
        chosen, taken, limit = {}, 0, share * sum(sizes.values())
        for u in (u for u in order if u in units):
            if chosen and taken + sizes[u] > limit:
                break
            chosen[u], taken = units[u], taken + sizes[u]
        return DeviceSteps(optimizer, chosen, order, self.device, self.stepper, keep_state=keep_state)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Under ``vram_budget_gb``, plan room for the first ``optimizer.step()``'s peak as well (it
        matters when the optimizer's state waits on the host between steps and comes back to step)."""
        if self.budget is not None:
            self._watched.append(optimizer)  # and the state of weights its first step did not train
            self._optimizer_hooks.append(optimizer.register_step_post_hook(
                lambda opt, args, kwargs: self.budget.optimizer_stepped()))

    def _queue_host_steps(self, optimizer, args, kwargs) -> None:
        for unit, reals in self.stepper.reals.items():
            grads = {id(p): p.grad for p in reals if p.grad is not None}
            if grads:
                self.stepper.submit(unit, grads)
                for p in reals:
                    p.grad = None  # the worker steps them; optimizer.step() skips them

    def _check_step_order(self, optimizer, args, kwargs) -> None:
        if self.grad_sink is None or not self.grad_sink.produced:
            return
        ours = {id(p) for p in self.plan.host_trainable}
        if any(id(p) in ours for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError("optimizer.step() before OffloadTrainingManager.after_backward(): the gradients of "
                               "host-resident weights have not landed yet; call after_backward() first")

    # --- public verbs ------------------------------------------------------------------------------
    def after_backward(self) -> None:
        """Land host gradients, average gradients over ranks, close the step (evicting trainable units)."""
        self._check_attached()
        self._release()
        if self.averager is not None:
            self.averager.average()
        self._end_step()
        self.stats["steps"] += 1

    def sync(self) -> None:
        """Wait for the queued host optimizer steps, so the trainable weights can be read directly
        (running the model needs no sync: each unit waits for its own step before it loads)."""
        if self.stepper is not None:
            self.stepper.join()

    def detach(self, restore_frozen: bool = True) -> nn.Module:
        """Remove every hook and give the model back in place; ``restore_frozen=False`` releases the
        frozen unit weights (meta tensors) instead of restoring them."""
        self._check_attached()
        self._release()
        try:
            if self.stepper is not None:
                self.stepper.close()  # a failed host step is raised after the model is given back
            if self.device_steps is not None:
                self.device_steps.close()
        finally:
            self.streamer.evict_all()
            handles = [h for hs in self._handles.values() for h in hs] + [self._inference_hook]
            for h in handles + self._optimizer_hooks + ([self._order_hook] if self._order_hook else []):
                h.remove()
            if self.grad_sink is not None:
                self.grad_sink.remove()
            if self.streamer.cuda:  # no copy may still read the host memory we are about to hand back
                torch.cuda.synchronize(self.device)
            self.plan.restore(self.arena.buffer, frozen=restore_frozen,
                              in_place=not isinstance(self.arena, SharedHostArena))
            self.arena.release()
            if self.grad_sink is not None:
                self.grad_sink.arena.release()
            self.streamer = None
            delattr(self.model, _MARK)
        return self.model

    def _release(self) -> None:
        self.streamer.evict_all(keep=lambda u: u.index not in self._trainable_units)
        if self.grad_sink is not None and self.streamer.cuda:  # the optimizer is about to rewrite host weights
            blocking_event(self.streamer.copy_stream).synchronize()
        self.sched.end_step()
        self._rehome_by_order()
        if self.grad_sink is not None:
            self.grad_sink.finish()

    def _rehome_by_order(self) -> None:
        """Homes follow the execution order just seen, so a prefetch window never shares a slot."""
        if self._order:
            rest = [u.index for u in self.plan.streamed if u.index not in self._order_seen]
            self.streamer.rehome(self._order + rest)
            self._order, self._order_seen = [], set()

    def loaded_units(self) -> list[str]:
        """Names of the streamed units whose weights are in the slots right now."""
        return [u.name for u in self.streamer.loaded_units()]

    def report(self) -> dict:
        """Sizes and traffic, for logs and tests."""
        budget = self.budget
        return {"units": len(self.plan.units), "streamed_units": len(self.plan.streamed),
                "budget_units": len(self.plan.budget), "compact_units": len(self.plan.compact),
                "streamed_bytes": sum(u.host_bytes for u in self.plan.streamed),
                "arena_bytes": self.arena.nbytes, "pinned": self.arena.pinned,
                "arena_shared": isinstance(self.arena, SharedHostArena),
                "slots": len(self.streamer.slots) if self.streamer else 0,
                "h2d_copies": self.streamer.copies if self.streamer else 0,
                "device_widenings": self.streamer.widenings if self.streamer else 0,
                "staged_ahead": self.streamer.staged_ahead if self.streamer else 0,
                "h2d_bytes": self.streamer.bytes if self.streamer else 0,
                "stalls": self.streamer.stalls if self.streamer else 0,
                "d2h_grad_bytes": self.grad_sink.d2h_bytes if self.grad_sink else 0,
                "fixed_device_bytes": self.plan.fixed_bytes(len(self.streamer.slots)) if self.streamer else None,
                "budget_bytes": budget.budget if budget else None,
                "planned_peak_bytes": budget.planned_peak if budget else None,
                "peak_bytes": budget.peak if budget else None,
                "gpu_peak_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
                "host_optimizer": dict(self.stepper.stats, threads=self.stepper.threads) if self.stepper else None,
                "device_steps": dict(self.device_steps.stats, units=len(self.device_steps.units))
                if self.device_steps else None,
                **self.stats}

    def _check_attached(self) -> None:
        if self.streamer is None:
            raise RuntimeError("this OffloadTrainingManager was detached")


def _warn_if_slots_hold_less_than_two_blocks(plan: Plan, model: nn.Module, block_container_names, n_slots: int) -> None:
    """Split units under a budget: the budget fills at a layer's granularity, but the slots shrink
    with the units, and with them how far the copies run ahead of compute.  Below two blocks' bytes
    compute waits for them (the 12-of-24 stack: two slots of a Linear 1.08-1.14x resident, six
    1.004-1.013x; docs/offload.md), so say which ``prefetch`` keeps two blocks' bytes in flight."""
    blocks = find_blocks(model, block_container_names)
    streamed = [u.dev_bytes for u in plan.units if u.dev_bytes > 0]
    if not blocks or not streamed:
        return
    slot, block = max(streamed), max(module_bytes(b) for b in blocks)
    if slot >= block or n_slots * slot >= 2 * block:  # nothing split below a block, or slots enough
        return
    warnings.warn(f"offload.cpu_offload_split_threshold makes {n_slots} slots of {slot / MIB:.1f} MiB, less than "
                  f"two of the largest blocks ({2 * block / MIB:.1f} MiB): the copies can run only that far ahead "
                  f"of compute, which then waits for them; offload.prefetch = {-(-2 * block // slot) - 1} keeps two "
                  "blocks' bytes in flight", RuntimeWarning, stacklevel=3)


def _check_options(prefetch: int, vram_budget_gb, split_threshold, storage_dtype) -> None:
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if vram_budget_gb != "auto" and (isinstance(vram_budget_gb, str) or vram_budget_gb < 0):
        raise InputError(f"offload.vram_budget_gb must be a number of GiB >= 0 or 'auto', got {vram_budget_gb!r}")
    if split_threshold is not None and split_threshold <= 0:
        raise InputError(f"offload.cpu_offload_split_threshold must be > 0 (MB), got {split_threshold!r}")
    if isinstance(storage_dtype, str) and storage_dtype != PACKED:
        raise InputError(f"offload.storage_dtype must be a torch dtype or {PACKED!r}, got {storage_dtype!r}")
