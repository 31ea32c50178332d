"""Print the targets of issue 12 from the JSON the H200 session wrote: ``python3 bench/summarise_h200.py DIR``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(folder: Path, name: str) -> dict:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else {}


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def rows(folder: Path):
    sbs = {f"{prefix}{name}": row for file, prefix in (("side_by_side_h200.json", ""),
                                                       ("side_by_side_peak_h200.json", "peak-run "),
                                                       ("side_by_side_compact_h200.json", "compact-run "))
           for name, row in _load(folder, file).get("rows", {}).items()}
    for name, row in sbs.items():
        yield f"stack {name}", {k: row.get(k) for k in ("step_s", "step_over_bound", "step_over_resident", "peak_gib",
                                                       "h2d_gb_per_step", "stalls")} if "error" not in row \
            else {"error": row["error"][-300:]}
    off = _load(folder, "offload_h200.json")
    optim = _load(folder, "offload_optim_h200.json").get("optim")  # a later run of that case alone
    if optim:
        off["optim"] = optim
    second = _load(folder, "offload_fp8_16gb_h200.json").get("qwen20b") or {}
    cases = [(case, off.get(case)) for case in ("qwen20b", "optim", "fp8_loss", "determinism")]
    compact = [(f"qwen20b {tag}", _load(folder, f"offload_fp8_16gb_compact{suffix}_h200{run}.json").get("qwen20b"))
               for tag, suffix, run in (("compact-run1", "", ""), ("compact-run2", "", "_run2"),
                                        ("compact-run3", "", "_run3"), ("compact-prefetch2", "_prefetch2", ""))]
    for case, res in [*cases, ("qwen20b peak-run", second), *compact]:
        for name, row in (res or {}).items():
            if isinstance(row, dict):
                keep = ("step_s", "step_over_resident", "step_over_max_gpu_or_cpu_adamw", "gpu_peak_torch_gb",
                        "gpu_peak_nvml_gb", "host_peak_over_dit", "budget_units", "compact_units", "h2d_gb_per_step",
                        "planned_h2d_gb_per_step", "slowdown", "host_adamw_s_per_step", "error")
                yield f"{case} {name}", {k: (row[k][-300:] if k == "error" else row[k]) for k in keep if k in row}
            else:
                yield f"{case} {name}", {"value": row}
    widen = _load(folder, "widen_h200.json").get("widen") or _load(folder, "offload_fp8_16gb_h200.json").get("widen")
    if widen:
        yield "widen one Qwen-Image block", widen
    for name in ("e2e_h200.json", "e2e_full_h200_run1.json", "e2e_full_h200.json"):
        e2e = _load(folder, name)
        if e2e:
            yield name.removesuffix(".json"), {k: e2e.get(k) for k in (
                "s_per_step", "stages_s", "images_per_s", "gpu_peak_torch_gb", "gpu_peak_nvml_gb", "host_peak_gb",
                "host_peak_over_dit", "host_anon_peak_over_dit", "h2d_gb_per_step", "planned_h2d_gb_per_step",
                "resident_units")}


def main() -> None:
    for name, values in rows(Path(sys.argv[1])):
        print(f"{name:38s} " + " ".join(f"{k}={_fmt(v)}" for k, v in values.items() if v is not None))


if __name__ == "__main__":
    main()
