"""Pool interleaved rows (``bench/interleaved.py``, ``bench/musubi_harness.py --pairs``) run in several processes.

    python3 bench/pool_pairs.py bench/results/interleaved_budget_12_of_24_act_sliced_*_h200.json
    python3 bench/pool_pairs.py --ratio ours/musubi bench/results/three_way_swap13_*_h200.json

``--ratio KEY``: files of ``interleaved.rotate``'s rounds, the rounds' ratio KEY in place of the
pairs': ``bench/musubi_harness.py --ours`` (``musubi/resident``, ``ours/resident``, ``ours/musubi``)
or ``bench/interleaved.py --floor`` (``floor/resident``, ``ours/resident``, ``ours/floor``).

One process's pairs share what that process was dealt (its machine, its allocations), so the unit
of this estimate is the process: each file's mean pair ratio (with as many pairs in each order, an
effect of which side runs first cancels in it), then their mean with a 95 % interval (Student's t
over the files) and the median of the files' medians.  Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Student's t, two-sided 95 %, by degrees of freedom (1-30); beyond, the normal 1.96
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def ratios_in(doc: dict, key: str | None) -> list[float]:
    """A file's pair ratios, or (``key``) its rounds' ratio ``key``."""
    if key is None:
        return [p["ratio"] for p in doc["pairs"]]
    rounds = doc["rounds"]
    if rounds and key not in rounds[0]["ratios"]:
        raise ValueError(f"no ratio {key} in its rounds, which have {', '.join(rounds[0]['ratios'])}")
    return [r["ratios"][key] for r in rounds]


def pool(paths: list[Path], key: str | None = None) -> dict:
    files = {}
    for path in paths:
        try:
            ratios = ratios_in(json.loads(path.read_text()), key)
        except (KeyError, ValueError) as exc:  # not JSON, or not of this kind: say which file
            raise ValueError(f"{path}: {exc.__class__.__name__}: {exc}") from exc
        files[path.stem] = {"pairs": len(ratios), "median": round(statistics.median(ratios), 4),
                            "mean": round(statistics.mean(ratios), 4)}
    means = [f["mean"] for f in files.values()]
    out = {"files": files, "processes": len(means), "mean_of_means": round(statistics.mean(means), 4),
           "median_of_medians": round(statistics.median(f["median"] for f in files.values()), 4)}
    if len(means) > 1:
        half = (T95[len(means) - 2] if len(means) - 1 <= len(T95) else 1.96) * statistics.stdev(means) / len(means) ** 0.5
        out["mean_95"] = [round(out["mean_of_means"] - half, 4), round(out["mean_of_means"] + half, 4)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--ratio", default=None, help="rotated files: the rounds' ratio KEY (e.g. ours/musubi)")
    args = ap.parse_args()
    try:
        print(json.dumps(pool(args.files, args.ratio), indent=1))
    except (OSError, ValueError, KeyError) as exc:  # a missing file, not JSON, or not of this kind
        ap.exit(2, f"pool_pairs: {exc} (files of bench/interleaved.py or musubi_harness --pairs; with --ratio, "
                   f"of musubi_harness --ours or interleaved.py --floor)\n")


if __name__ == "__main__":
    main()
