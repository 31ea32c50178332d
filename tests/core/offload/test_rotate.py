"""bench/interleaved.rotate: every side in every position, and each round's ratios between the sides."""

import itertools
import json
import subprocess
import sys

from bench.interleaved import rotate


def test_every_order_in_turn_and_ratios_within_each_round():
    # a side's step takes its base time, 1 % more when it runs first (an order effect), and the
    # machine drifts 0.1 % slower with every segment: rotated over all six orders, the means of
    # the rounds' ratios keep the sides' own ratios to within the drift's share
    base = {"resident": 0.200, "musubi": 0.2012, "ours": 0.2010}
    runs, seen = [], []

    def run(side):
        first = not seen or seen[-1][1] == 2  # the first segment of a round
        seen.append((side, 0 if first else seen[-1][1] + 1))
        t = base[side] * (1.01 if first else 1.0) * (1 + 0.001 * len(runs))
        runs.append(side)
        return {"step_s": t, "step_s_all": [t, t]}

    out = rotate(run, ("resident", "musubi", "ours"), rounds=6, warmup=1)
    orders = [tuple(r["order"]) for r in out["rounds"]]
    assert orders == list(itertools.permutations(("resident", "musubi", "ours")))
    for side in base:  # six rounds: each side twice in each position
        assert sum(o.index(side) == 0 for o in orders) == 2
    first = out["rounds"][0]
    assert first["ratios"]["ours/musubi"] == first["ours"]["step_s"] / first["musubi"]["step_s"]
    assert set(out["mean_ratio"]) == {"musubi/resident", "ours/resident", "ours/musubi"}
    assert abs(out["mean_ratio"]["ours/musubi"] - base["ours"] / base["musubi"]) < 0.0015
    assert abs(out["mean_ratio"]["ours/resident"] - base["ours"] / base["resident"]) < 0.0015
    assert first["resident"]["step_ms_all"] == [round(first["resident"]["step_s"] * 1e3, 2)] * 2


def _interleaved(*args):
    return subprocess.run([sys.executable, "-m", "bench.interleaved", "--mode", "budget_12_of_24_act", "--budget-gib",
                           "1", "--size", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", *args],
                          capture_output=True, text=True, timeout=300)


def test_floor_rotates_resident_the_rows_bytes_and_the_row():
    """``--floor``: the row's bytes beside resident compute with its block inputs offloaded as the row
    offloads them ("floor"), rotated with resident and the row itself (attached: it reports its plan)."""
    for floor, copies in (("plain", "resident_copies_act"), ("gated", "resident_copies_gated_act")):
        run = _interleaved("--floor", floor, "--copy-gib", "0.0001", "--pairs", "1")
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["sides"] == {"resident": "resident", "floor": copies, "ours": "budget_12_of_24_act"}
        (round_,) = out["rounds"]
        assert set(round_["ratios"]) == {"floor/resident", "ours/resident", "ours/floor"}
        assert round_["ratios"]["ours/floor"] == round_["ours"]["step_s"] / round_["floor"]["step_s"]
        assert "resident_units" in round_["ours"] and "resident_units" not in round_["floor"]
        # every other block of the tiny stack's 4 copies its bytes in the forward and again in the
        # checkpoint's recompute (a hook on the block itself misses the recompute: half the bytes)
        assert round_["floor"]["h2d_gb_per_step"] == 4 * int(0.0001 * 2**30) / 1e9


def test_floor_without_its_bytes_is_one_line():
    run = _interleaved("--floor")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines()[-1].endswith("--floor needs --copy-gib: the row's weight bytes a step / 24, in GiB")
