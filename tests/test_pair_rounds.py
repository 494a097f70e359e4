"""bench/pair_rounds.py, which reads the `pair` stage's rounds (two servers up at once) into an A/B:
each tree's ratios by round and the median of the within-round differences. Run as the stage runs
it, on files shaped like constrained_tbt.py's --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "pair_rounds.py"


def wave_pair(batch: int, ratio: float, stolen: float = 0.0) -> dict:
    return {"batch": batch, "tpot_ratio": ratio, "steady_tpc_ratio": ratio,
            "steal_p50": {"unconstrained": 0.0, "constrained": stolen}}


def write_rounds(folder: Path, ratios: dict[str, list[float]]) -> list[Path]:
    """pair_<round>_<tree>.json for each tree's ratios (batch 128; batch 256 at ratio + 0.1)."""
    paths = []
    for tree, by_round in ratios.items():
        for number, ratio in enumerate(by_round, 1):
            path = folder / f"pair_{number}_{tree}.json"
            path.write_text(json.dumps({"rows": [wave_pair(128, ratio), wave_pair(256, ratio + 0.1, 0.3)]}))
            paths.append(path)
    return paths


def run(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True)


def test_pairs_the_trees_within_each_round(tmp_path: Path) -> None:
    paths = write_rounds(tmp_path, {"base": [1.00, 1.10, 1.02], "current": [1.03, 1.05, 1.02]})
    result = run(paths)
    assert result.returncode == 0, result.stderr
    batch_128 = result.stdout.split("batch 256")[0]
    assert "base: median 1.020 (1.000-1.100, 3 rounds)" in batch_128
    assert "current: median 1.030 (1.020-1.050, 3 rounds)" in batch_128
    # Differences +0.03, -0.05, 0.00: their median, not the difference of the medians (+0.010).
    assert "median +0.000 (-0.050 to +0.030), current lower in 1 of 3" in batch_128
    assert "round 2: base 1.100 (steady 1.100; stolen 0.00 / 0.00); current 1.050" in batch_128
    assert "stolen 0.00 / 0.30" in result.stdout.split("batch 256")[1]


def test_a_round_missing_one_tree_is_not_paired(tmp_path: Path) -> None:
    paths = write_rounds(tmp_path, {"base": [1.00, 1.20], "current": [1.01]})
    result = run(paths)
    assert result.returncode == 0, result.stderr
    assert "current lower in 0 of 1" in result.stdout
    assert "base: median 1.100 (1.000-1.200, 2 rounds)" in result.stdout


def test_says_where_each_trees_json_schema_steps_spent_the_host(tmp_path: Path) -> None:
    def waves(off_cpu_ms: float, fill_wait_ms: float) -> dict:
        phases = {"schedule": {"wall_s": 1.0 + off_cpu_ms, "cpu_s": 1.0},  # wall minus CPU: off its CPU
                  "gpu_wait": {"wall_s": 3.0, "cpu_s": 0.1},  # a wait: apart, not in the own phases
                  "fill_wait": {"wall_s": fill_wait_ms, "cpu_s": 0.0},
                  "fill.masks": {"wall_s": 2.0, "cpu_s": 0.0}, "fill.guard": {"wall_s": 0.01, "cpu_s": 0.0}}
        return {"constrained": [{"phases": phases}], "unconstrained": []}

    paths = []
    for number, (off_cpu_ms, fill_wait_ms) in enumerate([(1.2, 0.5), (0.8, 0.7)], 1):
        path = tmp_path / f"pair_{number}_base.json"
        row = {**wave_pair(256, 1.0), "engine_by_round": waves(off_cpu_ms, fill_wait_ms)}
        path.write_text(json.dumps({"rows": [row]}))
        paths.append(path)
    result = run(paths)
    assert result.returncode == 0, result.stderr
    # Phases under 0.05 ms a step in every round (fill.guard) are left out.
    assert ("json_schema steps, ms: own 1.80-2.20, off CPU 0.80-1.20, gpu_wait 3.00-3.00, fill_wait 0.50-0.70, "
            "fill.masks 2.00-2.00\n") in result.stdout


def test_a_file_not_named_by_round_and_tree_is_refused(tmp_path: Path) -> None:
    stray = tmp_path / "constrained_tbt.json"
    stray.write_text(json.dumps({"rows": [wave_pair(128, 1.0)]}))
    result = run([stray])
    assert result.returncode != 0
    assert "not a pair_<round>_<tree>.json" in result.stderr
