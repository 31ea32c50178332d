"""Optimizer state kept in host memory between steps (``offload.optimizer_state_on_host``).

An optimizer's state (AdamW: two fp32 moments per trainable weight) is read only inside
``optimizer.step()``, yet it sits on the GPU through every forward and backward, where memory
peaks: for a LoRA in fp32 it is twice the adapters' own bytes.  Here it lives in page-locked host
memory between steps.  A pre-hook of ``step()`` copies it in (stream-ordered after the previous
step's copies out), the optimizer steps on the GPU exactly as it would have (same kernels, same
values: bitwise the same update), and a post-hook queues the copies out on a side stream, which
run beside the next forward.  The activations of the step are freed by then, so the state comes
back into memory the peak does not use.

Cost: the state's bytes cross PCIe once each way per step; the copy in is on the step's path (the
optimizer cannot start before it), the copy out overlaps the next forward.  Scalars (AdamW's
``step`` count, on the GPU for the fused and capturable kernels) stay where they are.  Optimizer
state that is already on the host (``enable_optimizer_cpu_offload``, or a CPU run) is left alone.
"""

from __future__ import annotations

import weakref

import torch

from .arena import HostArena, typed_view
from .units import align_up


def _moves(key: str, value, param: torch.Tensor, keys) -> bool:
    """State worth keeping on the host: a tensor of the parameter's (CUDA) device, not a scalar."""
    return (keys is None or key in keys) and isinstance(value, torch.Tensor) and value.device == param.device \
        and param.device.type == "cuda" and value.numel() > 1


class HostOptimizerState:
    """Keeps ``optimizer``'s per-parameter tensor state in pinned host memory between steps.

    Works for any optimizer that keeps its state in ``optimizer.state[param]`` and only reads it in
    ``step()``.  The state is laid out in host arenas (one per batch of new state, normally one);
    each step copies an arena in as one buffer whose views the optimizer updates in place, and out
    again as one copy (a launch per tensor would cost the host ~10 us each, thousands a step for a
    DiT's LoRA).  ``state_dict()`` waits for the copies out; ``load_state_dict()`` (which puts the
    state on the parameters' device) sends it straight back to the host.  ``keys``: only these state
    entries (e.g. ``("exp_avg_sq",)``: half of AdamW's state for half the copies); ``None``: all.
    ``stats``: bytes held on the host and copied each way."""

    def __init__(self, optimizer: torch.optim.Optimizer, keys: tuple[str, ...] | None = None):
        self.optimizer = optimizer
        self.keys = keys
        self.homes: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), key) -> pinned host view
        self.arenas: list[tuple[HostArena, list[tuple[torch.Tensor, str, int]]]] = []  # arena, (param, key, offset)
        self.on_device: dict[int, torch.Tensor] = {}  # arena index -> its device copy during a step
        self.stream: torch.cuda.Stream | None = None
        self.copied_out: torch.cuda.Event | None = None
        self.stats = {"host_bytes": 0, "h2d_bytes": 0, "d2h_bytes": 0, "steps": 0}
        self.handles = [optimizer.register_step_pre_hook(self._bring_in),
                        optimizer.register_step_post_hook(self._send_out),
                        optimizer.register_state_dict_pre_hook(lambda opt: self.wait()),
                        optimizer.register_load_state_dict_post_hook(self._after_load)]
        self._pinned: list[HostArena] = []  # every arena, for the finalizer to unpin
        weakref.finalize(self, HostOptimizerState._unpin, self._pinned)

    # --- the two hooks of step() --------------------------------------------------------------------
    def _bring_in(self, optimizer, args, kwargs) -> None:
        for index, (arena, members) in enumerate(self.arenas):
            at_home = [(param, key, offset) for param, key, offset in members
                       if optimizer.state.get(param, {}).get(key) is self.homes[(id(param), key)]]
            if not at_home:
                continue  # on the device already (loaded there)
            device = at_home[0][0].device
            stream = torch.cuda.current_stream(device)
            if self.copied_out is not None:
                stream.wait_event(self.copied_out)  # the last copies out write what we read
            on_device = torch.empty(arena.nbytes, dtype=torch.uint8, device=device)
            on_device.copy_(arena.buffer[:arena.nbytes], non_blocking=True)
            for param, key, offset in at_home:
                home = self.homes[(id(param), key)]
                optimizer.state[param][key] = typed_view(on_device, offset, home.dtype, home.shape)
            self.on_device[index] = on_device
            self.stats["h2d_bytes"] += arena.nbytes

    def _send_out(self, optimizer, args, kwargs) -> None:
        moving = [(param, entry, key, value) for param, entry in self._entries()
                  for key, value in entry.items() if _moves(key, value, param, self.keys)]
        if not moving:
            return
        self._make_homes(moving)
        device = moving[0][0].device
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))  # after the step wrote the state
        with torch.cuda.stream(self.stream):
            done = self._bulk_out(moving)
            for param, entry, key, value in moving:  # state the optimizer replaced, or new state
                if (id(param), key) not in done:
                    home = self.homes[(id(param), key)]
                    home.copy_(value, non_blocking=True)
                    value.record_stream(self.stream)  # its memory is reused only once the copy has read it
                    entry[key] = home
                    self.stats["d2h_bytes"] += value.nbytes
            self.copied_out = self.stream.record_event()
        self.on_device = {}
        self.stats["steps"] += 1

    def _bulk_out(self, moving) -> set[tuple[int, str]]:
        """One copy per arena whose state the optimizer updated in place in its device buffer."""
        value_of = {(id(param), key): (entry, value) for param, entry, key, value in moving}
        done = set()
        for index, on_device in self.on_device.items():
            arena, members = self.arenas[index]
            base = on_device.data_ptr()
            in_place = all((id(p), k) in value_of and value_of[(id(p), k)][1].data_ptr() == base + off
                           for p, k, off in members)
            if not in_place:
                continue
            arena.buffer[:arena.nbytes].copy_(on_device, non_blocking=True)
            on_device.record_stream(self.stream)
            for param, key, _ in members:
                value_of[(id(param), key)][0][key] = self.homes[(id(param), key)]
                done.add((id(param), key))
            self.stats["d2h_bytes"] += arena.nbytes
        return done

    def _after_load(self, optimizer) -> None:
        """``load_state_dict`` placed the state on the device: back to the host before any forward."""
        self._send_out(optimizer, (), {})
        self.wait()

    # --- helpers ------------------------------------------------------------------------------------
    def _entries(self):
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                entry = self.optimizer.state.get(param)
                if entry:
                    yield param, entry

    def _make_homes(self, moving) -> None:
        """Pinned host tensors, in one new arena, for state that has none of its shape and dtype yet."""
        missing = []
        for param, _, key, value in moving:
            home = self.homes.get((id(param), key))
            if home is None or home.shape != value.shape or home.dtype != value.dtype:
                missing.append((param, key, value))
        if not missing:
            return
        offsets, total = [], 0
        for _, _, value in missing:
            offsets.append(total)
            total = align_up(total + value.nbytes)
        arena = HostArena(total)
        arena.pin()
        for (param, key, value), offset in zip(missing, offsets):
            self.homes[(id(param), key)] = typed_view(arena.buffer, offset, value.dtype, value.shape)
        # an earlier arena's member now homed here is dropped from it (its arena then copies bytes
        # nobody reads: harmless, and only after a reshape)
        moved = {(id(param), key) for param, key, _ in missing}
        for _, members in self.arenas:
            members[:] = [(p, k, o) for p, k, o in members if (id(p), k) not in moved]
        self.arenas.append((arena, [(param, key, offset) for (param, key, _), offset in zip(missing, offsets)]))
        self._pinned.append(arena)
        self.stats["host_bytes"] += total

    def wait(self) -> None:
        """Block until the queued copies out have landed (before the host reads the state)."""
        if self.copied_out is not None:
            self.copied_out.synchronize()

    def remove(self) -> None:
        """Stop moving the state (it stays where it is: on the host after a step)."""
        self.wait()
        for handle in self.handles:
            handle.remove()

    @staticmethod
    def _unpin(arenas: list[HostArena]) -> None:
        if any(a.pinned for a in arenas):
            torch.cuda.synchronize()  # no queued copy may still touch them
        for arena in arenas:
            arena.release()  # the state tensors keep their (now pageable) memory
