"""Print the figures behind issue 12's targets from every H200 JSON in a folder: ``python3 bench/summarise_h200.py DIR``.

Files are found by name (``side_by_side*``, ``offload*``, ``widen*``, ``determinism*``, ``e2e*``), so a new run's file is
summarised without editing this script; each line starts with the file's stem.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STACK_KEYS = ("step_s", "step_over_bound", "step_over_resident", "median_pair_ratio", "pooled_ratio", "peak_gib",
              "h2d_gb_per_step", "stalls", "error")  # median_pair_ratio, pooled_ratio: interleaved rows
OFFLOAD_KEYS = ("step_s", "step_over_resident", "step_over_resident_compiled", "host_issue_s",
                "step_over_max_gpu_or_cpu_adamw", "gpu_peak_gb", "gpu_peak_torch_gb",
                "gpu_peak_nvml_gb", "host_peak_over_dit", "budget_units", "compact_units", "h2d_gb_per_step",
                "planned_h2d_gb_per_step", "slowdown", "host_adamw_s_per_step", "gpu_forward_s",
                "gpu_after_forward_s", "error")
E2E_KEYS = ("s_per_step", "stages_s", "images_per_s", "gpu_peak_torch_gb", "gpu_peak_nvml_gb", "host_peak_gb",
            "host_peak_over_dit", "host_anon_peak_over_dit", "h2d_gb_per_step", "planned_h2d_gb_per_step",
            "resident_units")
DETERMINISM_KEYS = ("deterministic_runs_bitwise_equal", "deterministic_resume_bitwise_equal", "plain_runs_bitwise_equal",
                    "plain_max_loss_diff")
RUN_INFO = ("device", "torch", "size", "h2d_pinned_gb_s", "wall_s")  # about the run, not a row


def _pick(row: dict, keys: tuple[str, ...]) -> dict:
    return {k: (str(row[k])[-300:] if k == "error" else row[k]) for k in keys if k in row}


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def rows(folder: Path):
    for path in sorted(folder.glob("side_by_side*.json")):
        for name, row in json.loads(path.read_text()).get("rows", {}).items():
            yield f"{path.stem} {name}", _pick(row, STACK_KEYS)
    for path in sorted([*folder.glob("offload*.json"), *folder.glob("widen*.json")]):
        for case, result in json.loads(path.read_text()).items():
            if case in RUN_INFO or not isinstance(result, dict):
                continue
            if case == "widen":  # one measurement, not rows
                yield f"{path.stem} widen", result
                continue
            for name, row in result.items():
                if name not in RUN_INFO:
                    yield f"{path.stem} {case} {name}", _pick(row, OFFLOAD_KEYS) if isinstance(row, dict) \
                        else {"value": row}
    for path in sorted(folder.glob("determinism*.json")):
        yield path.stem, _pick(json.loads(path.read_text()).get("determinism", {}), DETERMINISM_KEYS)
    for path in sorted(folder.glob("e2e*.json")):
        yield path.stem, _pick(json.loads(path.read_text()), E2E_KEYS)


def main() -> None:
    for name, values in rows(Path(sys.argv[1])):
        print(f"{name:58s} " + " ".join(f"{k}={_fmt(v)}" for k, v in values.items() if v is not None))


if __name__ == "__main__":
    main()
