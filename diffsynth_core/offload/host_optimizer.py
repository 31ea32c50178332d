"""The optimizer step of host-resident weights, one unit at a time, on a worker thread.

With optimizer offload the trainable weights of the streamed units live in the host arena and
their gradients land there as backward produces them.  Stepping them all in ``optimizer.step()``
after backward leaves the GPU idle for the whole CPU step; instead each unit gets its own
*sub-optimizer*: the user's optimizer class and hyper-parameters over stand-in parameters that
always view the unit's host copy (the real parameters point into a device slot while the unit is
loaded), sharing the user's ``optimizer.state`` entries (so ``state_dict()``, checkpoints and
resume see one optimizer).  A worker thread runs the sub-steps, earliest unit in execution order
first among those whose gradients have landed, so the next forward, which waits for each unit's
step before copying it to the device, rarely waits long.  (Steps are queued as autograd *issues*
the gradients, well ahead of the GPU: the earliest unit's gradients are the last to arrive, so
picking it first regardless left the worker waiting for them while others' sat ready; with no
job ready it waits for the one queued first, whose copies the grad stream runs first.)  Element-wise optimizers (Adam, AdamW, SGD, ...) update each tensor from its
own state, so stepping unit by unit gives bitwise the same result as one ``step()`` over all.

The worker's CPU kernels (fused AdamW) split each tensor over intra-op threads in equal static
shares, so one thread that loses its core to another busy thread (the main thread launching GPU
work, autograd's device thread, CUDA's own) delays the whole kernel.  The worker therefore runs
with ``threads`` intra-op threads (default: the process's count minus two), leaving cores to the
threads that feed the GPU.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch
from torch import nn


class _StateOfReal:
    """``optimizer.state`` seen through stand-ins: ``state[stand_in]`` is the real parameter's entry.
    Read at each access: ``load_state_dict`` replaces the optimizer's state dict."""

    def __init__(self, optimizer: torch.optim.Optimizer, real_of: dict[int, nn.Parameter]):
        self.optimizer, self.real_of = optimizer, real_of

    def __getitem__(self, stand_in):
        return self.optimizer.state[self.real_of[id(stand_in)]]

    def get(self, stand_in, default=None):
        return self.optimizer.state.get(self.real_of[id(stand_in)], default)


def sub_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``groups`` (stand-ins), without its hooks."""
    cls = type(optimizer)
    sub = cls.__new__(cls)
    for key, value in optimizer.__dict__.items():  # settings a subclass __init__ stores (fused, ...)
        # not callables: an LR scheduler replaces ``optimizer.step`` with a wrapper bound to
        # ``optimizer`` itself, which would step all of its weights in place of the sub's
        if key not in ("state", "param_groups", "defaults") and "hook" not in key and not callable(value):
            sub.__dict__[key] = value
    torch.optim.Optimizer.__init__(sub, groups, optimizer.defaults)
    return sub


def groups_over(optimizer: torch.optim.Optimizer, group_of: dict[int, int], reals: list, stand_ins: list
                ) -> tuple[list[dict], list[int]]:
    """The user's groups that hold ``reals`` (``group_of``: id(parameter) -> group index), each with
    its settings and the ``stand_ins`` of its weights in their place; and those groups' indices."""
    used = sorted({group_of[id(real)] for real in reals})
    return [{**optimizer.param_groups[gi],
             "params": [s for s, real in zip(stand_ins, reals) if group_of[id(real)] == gi]} for gi in used], used


class _Job:
    def __init__(self, unit: int, seq: int, grads: list, events: list):
        self.unit, self.seq, self.grads, self.events = unit, seq, grads, events
        self.done = threading.Event()

    def ready(self) -> bool:
        """Its gradients are on the host (its device->host copies have run)."""
        return all(event.query() for event in self.events)


class _Landed:
    """A step that ran elsewhere (``device_steps``): done once its copies out have landed."""

    def __init__(self, event):
        self.event = event

    def is_set(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostStepper:
    """Steps ``optimizer`` for the parameters of each unit, on demand, off the main thread.

    ``units``: unit index -> list of (real parameter, host master tensor).  ``submit(unit, grads,
    events)`` queues the unit's step (``grads``: ``id(real parameter) -> host gradient``; missing
    ones are skipped like ``grad=None``; the worker first waits for ``events``, the device->host
    copies that produce them); ``wait(unit)`` blocks until that unit's last queued step ran;
    ``join()`` waits for all.  ``threads``: the worker's intra-op threads (``None``: all but two of
    the process's).  ``stats``: jobs run, seconds stepping, seconds the caller blocked in ``wait``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, units: dict[int, list[tuple[nn.Parameter, torch.Tensor]]],
                 threads: int | None = None):
        self.optimizer = optimizer
        own = torch.get_num_threads()  # read on the calling thread: fixes its count before the worker sets its
        self._process_threads = own  # given back when the worker stops (see _run)
        self.threads = max(1, own - 2) if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.stats = {"jobs": 0, "step_s": 0.0, "waited_s": 0.0}
        self.trace: list | None = None  # set to a list to record (what, unit, start, end) times
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.subs: dict[int, tuple[torch.optim.Optimizer, list[nn.Parameter], list[int]]] = {}
        self.reals: dict[int, list[nn.Parameter]] = {}
        for unit, pairs in units.items():
            pairs = [(real, master) for real, master in pairs if id(real) in group_of]
            if not pairs:
                continue
            stand_ins = [nn.Parameter(master) for _, master in pairs]
            groups, used = groups_over(optimizer, group_of, [real for real, _ in pairs], stand_ins)
            sub = sub_optimizer(optimizer, groups)
            sub.state = _StateOfReal(optimizer, {id(s): r for s, (r, _) in zip(stand_ins, pairs)})
            self.subs[unit] = (sub, stand_ins, used)
            self.reals[unit] = [real for real, _ in pairs]
        self._jobs: dict[int, _Job] = {}
        self._queue: list[_Job] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="splitflow-host-optimizer", daemon=True)
        self._thread.start()

    def sub_for(self, unit: int) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
        """``unit``'s sub-optimizer and stand-ins, with the hyper-parameters the user's groups hold now."""
        sub, stand_ins, used = self.subs[unit]
        for sub_group, gi in zip(sub.param_groups, used):  # e.g. the LR scheduler's latest lr
            sub_group.update({k: v for k, v in self.optimizer.param_groups[gi].items() if k != "params"})
        return sub, stand_ins

    def submit(self, unit: int, grads: dict, events: list = ()) -> None:
        """Queue ``unit``'s step with the hyper-parameters the user's groups hold now."""
        self.sub_for(unit)  # its hyper-parameters brought up to date; the worker steps it later
        job = _Job(unit, next(self._seq), [grads.get(id(r)) for r in self.reals[unit]], list(events))
        with self._cv:
            self._jobs[unit] = job
            self._queue.append(job)
            self._cv.notify()

    def track(self, unit: int, event) -> None:
        """``unit`` stepped on the device; its host weights are new once ``event`` (its copies out)
        has completed (``None``: already).  ``wait``, ``is_done`` and ``join`` see it like a job."""
        job = _Job(unit, next(self._seq), [], [])
        job.done = _Landed(event)
        with self._cv:
            self._jobs[unit] = job

    def wait(self, unit: int) -> None:
        job = self._jobs.get(unit)
        if job is not None and not job.done.is_set():
            t0 = time.perf_counter()
            job.done.wait()
            t1 = time.perf_counter()
            self.stats["waited_s"] += t1 - t0
            if self.trace is not None:
                self.trace.append(("wait", unit, t0, t1))
        self._raise()

    def is_done(self, unit: int) -> bool:
        job = self._jobs.get(unit)
        return job is None or job.done.is_set()

    def join(self) -> None:
        for job in list(self._jobs.values()):
            job.done.wait()
        self._raise()

    def close(self) -> None:
        """Run what is queued and stop the worker; a worker's error is raised once it stopped."""
        try:
            self.join()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify()
            self._thread.join()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("the host optimizer step failed") from self._error

    def _run(self) -> None:
        # Sizes this thread's OpenMP team; the caller's is already fixed (see __init__), though
        # threads that have not run parallel CPU work yet will also start with this count, so the
        # process's count is given back on the way out: a later run in this process (tests, the
        # demo) computes with the thread count it would have had, and so rounds the same way.
        torch.set_num_threads(self.threads)
        try:
            self._serve()
        finally:
            torch.set_num_threads(self._process_threads)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._pick()
            try:
                if self._error is None:
                    self._step(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread at wait()/join()
                self._error = exc
            finally:
                job.done.set()

    def _pick(self) -> _Job:
        """The earliest unit whose gradients have landed, else the job queued first (a unit's
        jobs run in the order they were queued)."""
        first: dict[int, _Job] = {}
        for job in self._queue:  # in the order queued
            first.setdefault(job.unit, job)
        ready = [job for job in first.values() if job.ready()]
        job = min(ready, key=lambda j: j.unit) if ready else self._queue[0]
        self._queue.remove(job)
        return job

    def _step(self, job: _Job) -> None:
        t_pop = time.perf_counter()
        for event in job.events:  # the gradients' device->host copies (blocking events: no spinning)
            event.synchronize()
        sub, stand_ins, _ = self.subs[job.unit]
        for stand_in, grad in zip(stand_ins, job.grads):
            stand_in.grad = grad
        t0 = time.perf_counter()
        try:
            sub.step()
        finally:
            for stand_in in stand_ins:
                stand_in.grad = None
            t1 = time.perf_counter()
            self.stats["jobs"] += 1
            self.stats["step_s"] += t1 - t0
            if self.trace is not None:
                self.trace.append(("grads", job.unit, t_pop, t0))
                self.trace.append(("step", job.unit, t0, t1))
