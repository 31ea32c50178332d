"""bench/pool_pairs.py: the per-process estimate behind the 12-of-24 row's figures."""

import json

from bench.pool_pairs import pool


def test_processes_are_the_unit_each_averaging_its_pairs(tmp_path):
    runs = {"a": [0.997, 1.013, 0.997, 1.013], "b": [1.004, 1.006], "c": [1.001, 1.003, 1.002]}
    paths = []
    for name, ratios in runs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"pairs": [{"ratio": r} for r in ratios]}))
        paths.append(path)
    out = pool(paths)
    assert out["files"]["a"] == {"pairs": 4, "median": 1.005, "mean": 1.005}
    assert out["processes"] == 3 and out["mean_of_means"] == round((1.005 + 1.005 + 1.002) / 3, 4)
    assert out["median_of_medians"] == 1.005
    low, high = out["mean_95"]  # t with 2 degrees of freedom: 4.303 x sd / sqrt(3)
    assert low < 1.002 < 1.005 < high and round(high - out["mean_of_means"], 4) == round(4.303 * 0.0017321 / 3 ** 0.5, 4)


def test_rotated_rounds_pool_by_the_ratio_asked_for(tmp_path):
    """``bench/musubi_harness.py --ours`` files: rounds of three sides, pooled by one of their ratios."""
    paths = []
    for name, values in {"a": [0.998, 1.000], "b": [0.996, 0.998]}.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"rounds": [{"ratios": {"ours/musubi": v, "ours/resident": 1.004}}
                                               for v in values]}))
        paths.append(path)
    out = pool(paths, "ours/musubi")
    assert out["files"]["a"]["mean"] == 0.999 and out["files"]["b"]["mean"] == 0.997
    assert out["mean_of_means"] == 0.998
    assert pool(paths, "ours/resident")["mean_of_means"] == 1.004
