"""Gradients of host-resident trainable weights (optimizer offload) and data-parallel averaging.

With optimizer offload a trainable weight lives on the host and is streamed in with its unit.  Its
gradient is produced on the device by AccumulateGrad; the post-accumulate hook immediately queues a
device->host copy on a side stream into a preallocated (pinned where possible) host buffer and drops
the device gradient, so gradients never pile up on the device.  ``finish()`` (from ``after_backward``)
waits for those copies and hands the host gradients to ``param.grad``, adding to what earlier
micro-steps accumulated: gradient accumulation works like it does without offload.

With ``start_steps(stepper, unit_of, multi_use)`` (the optimizer bound with ``overlap_backward``)
the host gradients never reach ``param.grad``: as soon as the last gradient of a unit is queued,
the unit's optimizer step is queued behind those copies (``HostStepper``), while backward goes on.
A unit that ran several times in the forward (``multi_use``) may get its gradient in several
pieces (on CUDA each reload makes autograd start a new accumulator), so its step waits for
``finish()``, which adds the pieces up first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .arena import host_copies


def blocking_event(stream) -> torch.cuda.Event:
    """An event recorded on ``stream`` whose ``synchronize()`` sleeps instead of spinning: a thread
    spinning on a core stalls the host optimizer's OpenMP threads (see ``host_optimizer``)."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


class HostGradSink:
    def __init__(self, params: list[nn.Parameter], device: torch.device, pin: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.arena, views = host_copies(params, pin)
        self.acc = {id(p): view for p, (_, view) in zip(params, views)}
        self.staging: dict[int, torch.Tensor] = {}  # only for accumulation across micro-steps
        self.hidden: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}  # host grads set aside while on device
        self.pending: dict[int, tuple[nn.Parameter, object, bool]] = {}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self.d2h_bytes = 0
        self.produced = False  # a backward produced host gradients that finish() has not landed
        self.stepper = None  # HostStepper: steps start as gradients land
        self.multi_use = None  # unit -> ran more than once in this forward
        self.unit_of: dict[int, int] = {}
        self.unit_size: dict[int, int] = {}
        self.landing: dict[int, dict[int, object]] = {}  # unit -> id(p) -> copy event
        self.queued: set[int] = set()  # parameters whose step is queued since the last finish()
        self.device_steps = None  # DeviceSteps: units whose step runs on the device (device_steps.py)

    def start_steps(self, stepper, unit_of: dict[int, int], multi_use, device_steps=None) -> None:
        """From now on each unit's optimizer step is queued once its gradients are (being) copied;
        the units of ``device_steps`` keep their gradients on the device and step there instead."""
        self.stepper, self.unit_of, self.multi_use = stepper, unit_of, multi_use
        self.device_steps = device_steps
        self.unit_size = {}
        for unit in unit_of.values():
            self.unit_size[unit] = self.unit_size.get(unit, 0) + 1

    def hide(self, p: nn.Parameter) -> None:
        """Called before ``p`` moves to the device: a host ``.grad`` must not meet a device gradient."""
        if p.grad is not None:
            self.hidden[id(p)] = (p, p.grad)
            p.grad = None

    def _on_grad(self, p: nn.Parameter) -> None:
        g = p.grad
        p.grad = None
        self.produced = True
        if id(p) in self.queued:  # its step is already queued: this is a second backward
            raise RuntimeError("a second backward before optimizer.step(): gradient accumulation needs the "
                               "optimizer bound with overlap_backward=False")
        if self.stepper is not None and id(p) in self.unit_of and not self.multi_use(self.unit_of[id(p)]):
            if self.device_steps is not None and self.unit_of[id(p)] in self.device_steps.units:
                self.queued.add(id(p))
                self.device_steps.on_grad(self.unit_of[id(p)], p, g)
            else:
                self._copy_and_step(p, g)
            return
        if id(p) in self.pending:  # a second backward before after_backward: fold the first one in
            self.hidden[id(p)] = (p, self._fold(id(p)))
        accumulate = id(p) in self.hidden
        dst = self._staging(p) if accumulate else self.acc[id(p)]
        self.pending[id(p)] = (p, self._copy(dst, g), accumulate)
        self.d2h_bytes += g.numel() * g.element_size()

    def _copy(self, dst: torch.Tensor, g: torch.Tensor):
        if not self.cuda:
            dst.copy_(g)
            return None
        produced = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            dst.copy_(g, non_blocking=True)
            g.record_stream(self.stream)  # keep g's memory alive until the copy ran
            return blocking_event(self.stream)

    def _copy_and_step(self, p: nn.Parameter, g: torch.Tensor) -> None:
        unit = self.unit_of[id(p)]
        landing = self.landing.setdefault(unit, {})
        self.queued.add(id(p))
        landing[id(p)] = self._copy(self.acc[id(p)], g)
        self.d2h_bytes += g.numel() * g.element_size()
        if len(landing) == self.unit_size[unit]:
            self._submit(unit)

    def _submit(self, unit: int) -> None:
        landing = self.landing.pop(unit)
        self.stepper.submit(unit, {key: self.acc[key] for key in landing},
                            [e for e in landing.values() if e is not None])

    def _staging(self, p: nn.Parameter) -> torch.Tensor:
        buf = self.staging.get(id(p))
        if buf is None:
            buf = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.arena.pinned)
            self.staging[id(p)] = buf
        return buf

    def _fold(self, key: int) -> torch.Tensor:
        """Wait for ``key``'s copy and return its host gradient (accumulated if needed)."""
        _, done, accumulate = self.pending.pop(key)
        if done is not None:
            done.synchronize()
        if accumulate:
            _, host = self.hidden.pop(key)
            return host.add_(self.staging[key])
        return self.acc[key]

    def finish(self) -> None:
        """Every queued copy has landed and every host gradient is back in ``param.grad`` (or, with
        steps started as gradients land, every unit that got gradients has its step queued).
        Parameters must already point at their host masters (the manager evicts first)."""
        self.produced = False
        self.queued.clear()
        for unit in list(self.landing):  # units some of whose parameters got no gradient
            self._submit(unit)
        if self.device_steps is not None:
            self.device_steps.flush()
        late: dict[int, dict[int, torch.Tensor]] = {}  # steps started here: unit -> id(p) -> gradient
        for key in list(self.pending):
            p = self.pending[key][0]
            if self.stepper is not None and key in self.unit_of:
                late.setdefault(self.unit_of[key], {})[key] = self._fold(key)
            else:
                p.grad = self._fold(key)
        for unit, grads in late.items():
            if self.device_steps is not None:  # a device unit the worker steps: its state comes home
                self.device_steps.before_host_step(unit)
            self.stepper.submit(unit, grads)
        for key in list(self.hidden):  # no new gradient this step: give the old one back
            p, host = self.hidden.pop(key)
            p.grad = host

    def remove(self) -> None:
        self.finish()
        for h in self.handles:
            h.remove()
        self.handles = []


class GradAverager:
    """Averages trainable gradients over the default process group, one flat bucket per
    (device, dtype), so every rank applies the same update (data parallel without DDP)."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.world = dist.get_world_size()
        self._gloo = None

    def _group_for(self, device: torch.device):
        if device.type == "cpu" and dist.get_backend() != "gloo":  # NCCL cannot reduce host tensors
            if self._gloo is None:
                self._gloo = dist.new_group(backend="gloo")
            return self._gloo
        return None

    def broadcast_params(self) -> None:
        for p in self.params:
            dist.broadcast(p.data, src=0, group=self._group_for(p.device))

    def average(self) -> None:
        buckets: dict[tuple, list[nn.Parameter]] = {}
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank must contribute the same shapes
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p)
        for (device, _), ps in buckets.items():
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            dist.all_reduce(flat, group=self._group_for(device))
            flat.div_(self.world)
            off = 0
            for p in ps:
                n = p.grad.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n
