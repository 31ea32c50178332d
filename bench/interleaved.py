"""All-resident steps and one of our engine's rows, alternately in one process.

    python -m bench.interleaved --mode budget_12_of_24_act --budget-gib G [--pairs 6] [--size tiny --device cpu]

``bench/side_by_side.py`` runs each row in its own process, one after the other, and takes the
ratio of their medians.  Between processes the GPU's clocks and the host drift: the resident row
alone has moved 0.271-0.282 s/step (4 %) from one call to the next, more than the 0.5 % the
12-of-24 target allows.  Here one model trains resident for a segment of steps, then under the
engine (attached, planned, timed, detached), and again, ``--pairs`` times, in the order ABBA so a
steady drift cancels; each pair gives a ratio of medians.  Prints one JSON document: the pairs,
the median of their ratios, the ratio of the pooled medians, and each side's peak.
``side_by_side --interleave MODE`` computes the budget and calls this.

Rows (``--mode``): side_by_side's, + ``_pN`` (N + 1 slots), + ``_leaves`` (blocks split into their
Linears), + ``_bwdstep`` (optimizer steps during backward, each segment with an optimizer of its own).
Diagnoses of where a row's time goes: ``resident_copies[_gated][_arena]`` (the bytes
alone, beside resident compute), a row + ``_nocopy`` (its schedule without its copies), +
``_samecopy`` (its copies, bringing bytes the slot already holds) and + ``_timed`` (its copies'
rates, and how long compute waited for each).  ``--floor --copy-gib G``: resident, the row's bytes
beside resident compute ("floor") and the row, rotated (``rotate``), so the row is measured
against what its bytes alone cost in the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time

import torch

from bench.dit_stack import LORA_INPUTS, SIZES, build, hook_every_use, stack_step, timed_steps
from bench.side_by_side import engine_options


class CopiesBesideCompute:
    """``resident_copies``: a host->device copy of ``nbytes`` (one streamed block's) on a side stream
    at every other block's forward and recompute, into a buffer compute never reads, so compute
    never waits for one.  What moving a 12-of-24 step's bytes costs the compute beside it (copy
    engine, memory traffic), apart from any engine's scheduling.  ``gated``
    (``resident_copies_gated``): each copy starts only once the compute queued before its hook has
    run, as the engine's copies wait for their slot; otherwise they start as soon as the host,
    running ahead of the GPU, issues them.  ``arena`` (``resident_copies_arena``): the copies read 12
    blocks' worth of host memory page-locked in place (``HostArena``, as the engine's weights are),
    a different block's region each time, instead of one buffer from ``cudaHostAlloc``.

    The copies hang on ``hook_every_use`` (forward and recompute: 24 a step in the full stack; a hook
    on the block missed the recompute, the ninth session's floor), and ``copies`` counts them."""

    def __init__(self, model, device, nbytes: int, gated: bool = False, arena: bool = False):
        from diffsynth_core.offload.arena import HostArena

        blocks = model.blocks[1::2]
        self.nbytes, self.copies, self.arena = nbytes, 0, None
        if arena:
            self.arena = HostArena(len(blocks) * nbytes)
            self.arena.buffer.fill_(1)  # touched, as weights copied in would be
            if device.type == "cuda":
                self.arena.pin()
            sources = [self.arena.region(i * nbytes, nbytes) for i in range(len(blocks))]
        else:
            sources = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")]
        self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.gated, self.device = gated, device
        self.hooks = [hook_every_use(block, self._copier(sources[i % len(sources)])) for i, block in enumerate(blocks)]

    def _copier(self, source):
        def copy(_module, _args):
            self.copies += 1
            if self.stream is None:
                self.scratch.copy_(source)
                return
            if self.gated:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.scratch.copy_(source, non_blocking=True)
        return copy

    def gb_per_step(self, steps: int) -> float:
        """The copies' GB a step over the ``steps`` steps run since they were hooked."""
        return self.copies / steps * self.nbytes / 1e9

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        if self.arena is not None:  # unpinned with the hooks: the next side's arena may get the same addresses
            from diffsynth_core.offload.arena import release_all

            release_all([self.arena])


def skip_repeat_copies(streamer, recopy: bool = False) -> None:
    """``_nocopy`` rows (a diagnosis, wrong weights): each slot's first copy lands as usual, every
    later one is skipped (its events still ordered as a copy's would be), so the slot keeps real
    weights of one unit and the step runs the engine's whole schedule (hooks, pointer swaps, event
    waits) without its host->device bytes.  ``recopy`` (``_samecopy`` rows): every later copy
    brings that first unit's bytes again, so the bytes move but what compute reads never changes."""
    copy, first = streamer._copy, {}

    def first_copy_only(unit, buf, views, after=()):
        settled = first.setdefault(buf.data_ptr(), unit)
        if settled is unit or not streamer.cuda or unit.casts:
            return copy(unit, buf, views, after)
        if recopy:  # the streamer's own copy, of the unit the slot already holds
            return copy(settled, buf, views, after)
        for event in after:
            streamer.copy_stream.wait_event(event)
        return streamer.copy_stream.record_event()
    streamer._copy = first_copy_only


class CopyWaits:
    """``_timed`` rows (a diagnosis): per host->device weight copy of the engine, when it ran on the
    copy stream and how long the compute stream sat waiting for it (from reaching the wait to the
    copy's end, on the GPU's clock), by the phase of the use that waited (F, R, B)."""

    def __init__(self, mgr):
        self.mgr, self.streamer = mgr, mgr.streamer
        self.phase, self.copies, self.waits = "F", {}, []
        copy, wait, use = self.streamer._copy, self.streamer.wait_ready, mgr._use
        timed = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

        def timed_copy(unit, buf, views, after=()):
            if unit.casts or unit.index in self.streamer.stored:
                return copy(unit, buf, views, after)
            stream = self.streamer.copy_stream
            for event in after:  # waited here, so that the copy's start is timed after them
                stream.wait_event(event)
            start, end = timed(), timed()
            start.record(stream)
            landed = copy(unit, buf, views)  # the streamer's own copy, on the same stream
            end.record(stream)
            self.copies[unit.index] = (start, end, unit.host_bytes, self.mgr.stats["steps"])
            return landed

        def timed_wait(unit):
            copied = self.copies.pop(unit.index, None)
            if copied is not None and unit.index in self.streamer.ready:
                reached = timed()
                reached.record()
                self.waits.append((self.phase, reached, *copied))
            return wait(unit)

        def phased_use(unit, phase):
            self.phase = phase
            return use(unit, phase)
        self.streamer._copy, self.streamer.wait_ready, mgr._use = timed_copy, timed_wait, phased_use

    def summary(self, from_step: int) -> dict:
        torch.cuda.synchronize()
        rows = [w for w in self.waits if w[-1] >= from_step]
        steps = len({w[-1] for w in rows}) or 1
        waited = {p: 0.0 for p in "FRB"}
        for phase, reached, _, end, _, _ in rows:
            waited[phase] += max(0.0, reached.elapsed_time(end))
        rates = sorted(n / (start.elapsed_time(end) / 1e3) / 1e9 for _, _, start, end, n, _ in rows)
        return {"copy_gb_s_median": rates[len(rates) // 2] if rates else None,
                "copy_gb_s_min": rates[0] if rates else None,
                "waited_ms_per_step": {p: round(ms / steps, 3) for p, ms in waited.items()},
                "copies_per_step": len(rows) / steps}


def engine_mode(mode: str) -> str:
    """The row a diagnosis runs (``static_12_of_24_timed`` -> ``static_12_of_24``)."""
    for suffix in ("_timed", "_nocopy", "_samecopy"):
        mode = mode.removesuffix(suffix)
    return mode


@contextlib.contextmanager
def side(model, device, mode: str, args):
    """``model`` set up as one side runs: ``mode`` "resident" (``resident_copies``: with copies beside
    it; ``resident_act``: with the checkpointed block inputs in host memory), or one of our rows
    attached; yields our engine (``None`` when resident) and the copies beside resident compute
    (``CopiesBesideCompute``, or ``None``), and undoes everything on exit."""
    from diffsynth_core.gradient import apply_gradient_checkpointing, remove_gradient_checkpointing
    from diffsynth_core.offload import OffloadTrainingManager

    apply_gradient_checkpointing(model, ("blocks",), offload_activations="_act" in mode)
    mgr, copies = None, None
    if mode.startswith("resident_copies"):
        copies = CopiesBesideCompute(model, device, int(args.copy_gib * 2**30), gated="_gated" in mode,
                                     arena="_arena" in mode)
    elif not mode.startswith("resident"):  # resident_act: resident, block inputs offloaded
        mgr = OffloadTrainingManager(model, device, block_container_names=("blocks",),
                                     **engine_options(engine_mode(mode), args.size, args.budget_gib))
        if mode.endswith(("_nocopy", "_samecopy")):
            skip_repeat_copies(mgr.streamer, recopy=mode.endswith("_samecopy"))
        if mode.endswith("_timed") and device.type == "cuda":
            mgr.copy_waits = CopyWaits(mgr)
    try:
        yield mgr, copies
    finally:
        if mgr is not None:
            streamer = mgr.streamer
            mgr.detach()
            # the diagnoses' wrappers close over the manager: drop them, or its slots outlive it
            for obj, names in ((streamer, ("_copy", "wait_ready")), (mgr, ("_use", "copy_waits"))):
                for name in names:
                    obj.__dict__.pop(name, None)
        if copies is not None:
            copies.remove()
        remove_gradient_checkpointing(model, ("blocks",))
        if device.type == "cuda":
            torch.cuda.empty_cache()


def segment(model, x, opt, device, mode: str, args) -> dict:
    """Timed steps of one side (see ``side``).  ``_bwdstep`` rows step during backward
    (``StepInBackward``, as ``offload.optimizer_step_in_backward`` runs it): with an optimizer of
    their own, new each segment (its state lives in the pager's host pages, which the resident
    side's optimizer cannot read), so its first steps are among the warm-up ones."""
    from diffsynth_core.offload.backward_steps import StepInBackward

    pager = None
    if "_bwdstep" in mode:
        opt = torch.optim.AdamW(opt.param_groups[0]["params"], lr=1e-4, fused=device.type == "cuda")
        pager = StepInBackward(opt, skip_nonfinite=device.type == "cuda")
    with side(model, device, mode, args) as (mgr, copies), contextlib.ExitStack() as undo:
        if pager is not None:
            undo.callback(pager.remove)
        out = timed_steps(stack_step(model, x, opt, mgr, pager), device, args.steps, args.warmup)
        out.pop("losses")
        if args.sampler is not None:  # over the timed steps, which end now
            end = time.perf_counter()
            out["clocks"] = args.sampler.window(end - sum(out["step_s_all"][args.warmup:]), end)
        if copies is not None:  # the floor's weight bytes, to set beside the row's
            out["h2d_gb_per_step"] = copies.gb_per_step(args.warmup + args.steps)
        if mgr is not None:
            rep = mgr.report()
            out.update(resident_units=rep["budget_units"], stalls=rep["stalls"],
                       resident_at=sorted(u.index for u in mgr.plan.budget),
                       h2d_gb_per_step=rep["last_step_h2d_bytes"] / 1e9)
            if hasattr(mgr, "copy_waits"):
                out["copy_waits"] = mgr.copy_waits.summary(from_step=args.warmup)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", required=True, help="one of side_by_side's rows without host optimizer or state "
                    "(+ _pN: N + 1 slots; + _leaves: blocks split into their Linears; + _bwdstep: optimizer steps "
                    "during backward), or resident_copies[_gated][_arena] (resident, with --copy-gib copied beside every other block); "
                    "a row + _nocopy / _samecopy: its schedule without its copies / copying unchanging bytes "
                    "(skip_repeat_copies); "
                    "+ _timed: its copies' rates and the compute's waits for them (CopyWaits)")
    ap.add_argument("--copy-gib", type=float, default=0.0, help="resident_copies: GiB per copy")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora-input", choices=LORA_INPUTS, default="narrow")
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--clocks", action="store_true", help="each side's mean SM clock, power and clock-event "
                    "reasons over its timed steps (bench/gpu_clocks.py, NVML)")
    ap.add_argument("--floor", nargs="?", const="plain", choices=("plain", "gated"), default=None,
                    help="rotate three sides, --pairs rounds (rotate): resident, 'floor' (resident with --copy-gib "
                    "copied beside every other block's forward and recompute, and the row's block inputs offloaded "
                    "if it offloads them: its bytes, no engine; 'gated': each copy waits for the compute queued "
                    "before it, as a copy into a ring's slot waits for the slot) and 'ours' (--mode); ratios "
                    "floor/resident, ours/resident, ours/floor")
    args = ap.parse_args()
    if args.floor and args.copy_gib <= 0:
        ap.error("--floor needs --copy-gib: the row's weight bytes a step / 24, in GiB")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu --size tiny checks the script on a CPU")
    from diffsynth_core.training.device import avoid_broken_kernels

    device = avoid_broken_kernels(args.device)
    args.sampler = None
    if args.clocks:
        from bench.gpu_clocks import ClockSampler

        args.sampler = ClockSampler(device.index or 0)
    model, x = build(args.size, device, lora_input=args.lora_input)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda")
    if args.floor:
        doc = floor_rounds(model, x, opt, device, args)
    else:
        alternated = alternate(lambda side: segment(model, x, opt, device, side, args), args.mode, args.pairs,
                               args.warmup)
        peaks = {side: max((p[side]["peak_gib"] or 0) for p in alternated["pairs"]) or None
                 for side in ("resident", "engine")}
        doc = {"mode": args.mode, "budget_gib": args.budget_gib, **alternated, "peak_gib": peaks}
    if args.sampler is not None:
        args.sampler.stop()
    print(json.dumps(doc))


def floor_rounds(model, x, opt, device, args) -> dict:
    """``--floor``: is the row slower than the bytes it moves?  'floor' moves as many bytes beside
    resident compute as the row does (``--copy-gib`` a copy at every other block's forward and
    recompute, 24 a step in the full stack; the block inputs' round trips when the row has them, by
    the same ``offload_activations``) with no engine's scheduling; rotated with resident and the
    row, ours/floor is what the engine adds to its bytes' own cost and floor/resident that cost on
    this machine at this moment."""
    # ``side`` reads the floor's variants from its name (resident_copies[_gated][_act])
    floor = "resident_copies" + ("_gated" if args.floor == "gated" else "") + ("_act" if "_act" in args.mode else "")
    modes = {"resident": "resident", "floor": floor, "ours": args.mode}
    out = rotate(lambda side: segment(model, x, opt, device, modes[side], args), tuple(modes), args.pairs,
                 args.warmup)
    return {"mode": f"floor_{args.floor}_{args.mode}", "budget_gib": args.budget_gib, "copy_gib": args.copy_gib,
            "sides": modes, **out}


def steps_in_ms(out: dict) -> None:
    """A ``timed_steps`` result's every step (warm-up included) kept as ``step_ms_all``, in ms to 0.01."""
    out["step_ms_all"] = [round(t * 1e3, 2) for t in out.pop("step_s_all")]


def alternate(run, engine: str, pairs: int, warmup: int) -> dict:
    """``pairs`` pairs of ``run("resident")`` and ``run(engine)`` (each a ``timed_steps`` result), in
    ABBA order so that steady drift cancels: the pairs (as "resident" / "engine"), each pair's ratio
    of medians, their median and mean, and the ratio of the sides' pooled medians.  Each pair's ratio goes to
    stderr as it lands (a run cut short by its time limit still shows how far it got)."""
    done = []
    for i in range(pairs):
        order = ("resident", engine) if i % 2 == 0 else (engine, "resident")
        runs = {side: run(side) for side in order}
        done.append({"resident": runs["resident"], "engine": runs[engine],
                     "ratio": runs[engine]["step_s"] / runs["resident"]["step_s"]})
        clocks = [runs[side].get("clocks", {}) for side in ("resident", engine)]
        seen = "" if not all("sm_mhz" in c for c in clocks) else (
            " (resident / engine: SM {} / {} MHz, {} / {} W)".format(*(c[k] for k in ("sm_mhz", "power_w") for c in clocks)))
        print(f"pair {i}: {done[-1]['ratio']:.4f}{seen}", file=sys.stderr, flush=True)
    pooled = {side: statistics.median(t for p in done for t in p[side]["step_s_all"][warmup:])
              for side in ("resident", "engine")}
    for p in done:
        for side in ("resident", "engine"):
            steps_in_ms(p[side])
    # mean_pair_ratio: with an even count of pairs, half of them in each order, an effect of which side
    # runs first cancels in the mean (the median of such pairs falls between two clusters)
    return {"pairs": done, "median_pair_ratio": statistics.median(p["ratio"] for p in done),
            "mean_pair_ratio": statistics.mean(p["ratio"] for p in done),
            "pooled_ratio": pooled["engine"] / pooled["resident"], "pooled_step_s": pooled}


def rotate(run, sides: tuple[str, ...], rounds: int, warmup: int) -> dict:
    """``rounds`` rounds of ``run(side)`` (a ``timed_steps`` result) for every side, the sides of round
    i in the order ``permutations(sides)[i % n!]``: over a multiple of n! rounds every side runs in
    every position equally often, so an effect of position cancels in the means (with two sides,
    ``alternate``'s ABBA).  Each round's ratio of medians for every pair of sides, later over earlier
    in ``sides`` ("b/a"), and per pair their median and mean over the rounds."""
    orders = list(itertools.permutations(sides))
    done = []
    for i in range(rounds):
        order = orders[i % len(orders)]
        runs = {side: run(side) for side in order}
        ratios = {f"{b}/{a}": runs[b]["step_s"] / runs[a]["step_s"] for a, b in itertools.combinations(sides, 2)}
        for side in sides:
            steps_in_ms(runs[side])
        done.append({"order": list(order), **runs, "ratios": ratios})
        print(f"round {i} ({' '.join(order)}): " + ", ".join(f"{k} {r:.4f}" for k, r in ratios.items()),
              file=sys.stderr, flush=True)
    keys = done[0]["ratios"] if done else {}
    return {"rounds": done, "warmup": warmup,
            "median_ratio": {k: statistics.median(r["ratios"][k] for r in done) for k in keys},
            "mean_ratio": {k: statistics.mean(r["ratios"][k] for r in done) for k in keys}}


if __name__ == "__main__":
    main()
