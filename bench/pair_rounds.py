"""The rounds of `bash bench/gpu_run.sh pair`, paired: two servers up at once (base and current), each
round one wave pair (plain, then json_schema) per batch size against each, the two taken back to
back. Per batch size: each tree's time-per-output-token ratios (json_schema / plain) by round, their
median and range, and the difference current - base within each round, whose median is the A/B.
A round in which the hypervisor took CPU from one tree's waves and not the other's shows it: the
cores it took in each wave are listed beside the ratio. Then where each tree's json_schema steps spent
the host's time, ms a step (range over the rounds; bench/host_phases.py).

    python bench/pair_rounds.py OUT/pair_*.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_phases import host_ranges  # noqa: E402

TREES = ("base", "current")


def load(paths: list[Path]) -> dict[int, dict[int, dict[str, dict]]]:
    """batch -> round -> tree -> that wave pair's row of constrained_tbt.py's JSON."""
    rounds: dict[int, dict[int, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for path in paths:
        match = re.fullmatch(r"pair_(\d+)_(base|current)\.json", path.name)
        if match is None:
            raise SystemExit(f"{path}: not a pair_<round>_<tree>.json")
        for row in json.loads(path.read_text())["rows"]:
            rounds[row["batch"]][int(match[1])][match[2]] = row
    return rounds


def wave(row: dict) -> str:
    steal = row["steal_p50"]
    return (f"{row['tpot_ratio']:.3f} (steady {row['steady_tpc_ratio']:.3f}; stolen "
            f"{steal['unconstrained']:.2f} / {steal['constrained']:.2f})")


def host_line(rows: list[dict]) -> str:
    """The json_schema waves of `rows`: where their steps spent the host's time (`host_phases`)."""
    return host_ranges([entry["phases"] for row in rows
                        for entry in row.get("engine_by_round", {}).get("constrained", [])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", type=Path, nargs="+")
    args = parser.parse_args()
    for batch, by_round in sorted(load(args.paths).items()):
        print(f"batch {batch}: time per output token, json_schema / plain (cores stolen plain / json_schema)")
        differences = []
        for number, trees in sorted(by_round.items()):
            print(f"  round {number}: " + "; ".join(f"{tree} {wave(trees[tree])}" for tree in TREES if tree in trees))
            if all(tree in trees for tree in TREES):
                differences.append(trees["current"]["tpot_ratio"] - trees["base"]["tpot_ratio"])
        for tree in TREES:
            ratios = [trees[tree]["tpot_ratio"] for trees in by_round.values() if tree in trees]
            if ratios:
                print(f"  {tree}: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, "
                      f"{len(ratios)} rounds)")
            spent = host_line([trees[tree] for trees in by_round.values() if tree in trees])
            if spent:
                print(f"    json_schema steps, ms: {spent}")
        if differences:
            print(f"  current - base within a round: median {statistics.median(differences):+.3f} "
                  f"({min(differences):+.3f} to {max(differences):+.3f}), current lower in "
                  f"{sum(d < 0 for d in differences)} of {len(differences)}")


if __name__ == "__main__":
    main()
