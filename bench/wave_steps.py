"""The engine steps of each wave of a bench/constrained_tbt.py run, constrained against unconstrained.

Start the server with LLGTRT_STEP_LOG=<path> (one JSON line per engine step, engine/step_profile.py),
run bench/constrained_tbt.py --json <out>, then

    python3 bench/wave_steps.py --steps <path> --result <out> [--batch 256]

Each wave's window (its start and end by the machine's monotonic clock) picks its steps from the log.
Per wave: steps, steps that prefilled prompts in a pass (prompt tokens, their wall time), prompts
that rode a queued decode, the median decode-only step, when the last prompt joined, the wall ms of
the steps until then (admission), the median step after it while 80 % of the wave's rows or more
decode (steady), the rows' sit-outs (a slow grammar's row whose mask was late) and the steps left to
5 % of the rows or fewer (stragglers), and each phase's wall ms summed over the wave: where a
constrained wave spent the time an unconstrained one did not.
Then, per kind over all its waves, the decode-only steps' distribution: a json_schema cost that lies
in a tail of slow steps, not in the median, shows there, with the fill waits and, where the log has
them, the collector's pauses and the engine thread's preemptions in the slow steps (> 2x the median).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Iterator, Optional


def read_steps(path: Path) -> list[dict[str, Any]]:
    with path.open() as lines:
        return [json.loads(line) for line in lines if line.strip()]


def steps_in(steps: list[dict[str, Any]], started: float, ended: float) -> list[dict[str, Any]]:
    """The steps that ended inside a wave's window."""
    return [s for s in steps if started <= s["ended"] <= ended]


def wall_ms(step: dict[str, Any]) -> float:
    """A step's wall time: the sum of its phases."""
    return sum(step["ms"].values())


def decode_only(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that prefilled no prompt, in a pass or riding the decode."""
    return [s for s in steps if not s.get("prefill") and not s.get("riders")]


def wave_summary(steps: list[dict[str, Any]], started: float, ended: float) -> dict[str, Any]:
    mine = steps_in(steps, started, ended)
    prefill = [s for s in mine if s.get("prefill")]
    decoding = [wall_ms(s) for s in decode_only(mine)]
    last_join = max((k for k, s in enumerate(mine) if s.get("admitted") or s.get("riders")), default=-1)
    peak = max((s["decode"] for s in mine), default=0)
    # After the last prompt joined, the steps most of the wave's rows decode in, and the steps a few
    # rows are left to (a slow grammar's rows that sat steps out end last).
    steady = [wall_ms(s) for s in mine[last_join + 1:] if s["decode"] >= 0.8 * peak]
    phases: dict[str, float] = {}
    for s in mine:
        for name, ms in s["ms"].items():
            phases[name] = phases.get(name, 0.0) + ms
    return {"seconds": ended - started, "steps": len(mine), "prefill_steps": len(prefill),
            "prefill_tokens": sum(s["prefill"] for s in prefill),
            "prefill_ms": sum(wall_ms(s) for s in prefill),
            "riders": sum(s.get("riders", 0) for s in mine),
            "decode_step_ms_p50": statistics.median(decoding) if decoding else float("nan"),
            "last_join_s": (mine[last_join]["ended"] - started) if last_join >= 0 else float("nan"),
            "admission_ms": sum(wall_ms(s) for s in mine[:last_join + 1]),
            "steady_step_ms_p50": statistics.median(steady) if steady else float("nan"),
            "sat_out": sum(s.get("sat_out", 0) for s in mine),
            "straggler_steps": sum(0 < s["decode"] <= max(1, 0.05 * peak) for s in mine),
            "phases_ms": phases}


def tail_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The decode-only steps' wall ms (median, mean, p90, p99), their mean fill wait, the share that
    waited over 1 ms for the fill, and, in the steps over twice the median, the collector's pauses
    and the engine thread's preemptions (a step log written before those fields: None)."""
    decoding = decode_only(steps)
    if not decoding:
        return {"steps": 0}
    wall = sorted(wall_ms(s) for s in decoding)
    waits = [s["ms"].get("fill_wait", 0.0) for s in decoding]
    median = statistics.median(wall)
    slow = [s for s in decoding if wall_ms(s) > 2 * median]
    logged = all("gc_ms" in s for s in slow)
    return {"steps": len(wall), "p50": median, "mean": statistics.mean(wall),
            "p90": wall[int(0.9 * (len(wall) - 1))], "p99": wall[int(0.99 * (len(wall) - 1))],
            "fill_wait_mean": statistics.mean(waits), "waited_over_1ms": sum(w > 1.0 for w in waits) / len(waits),
            "slow_steps": len(slow),
            "slow_gc_ms": sum(s["gc_ms"] for s in slow) if logged else None,
            "slow_preempted": sum(s["preempted"] or 0 for s in slow) if logged else None}


def result_rows(path: Path, batch: Optional[int]) -> list[dict[str, Any]]:
    """The rows of a bench/constrained_tbt.py --json output, only `batch`'s when given."""
    result = json.loads(path.read_text())
    result = result.get("result", result)  # run_main's file wraps the benchmark's own
    return [row for row in result["rows"] if batch is None or row["batch"] == batch]


def waves(row: dict[str, Any]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(kind, index, window) of each wave of a result row, unconstrained ones first."""
    for kind in ("unconstrained", "constrained"):
        for index, window in enumerate(row["engine_by_round"][kind]):
            yield kind, index, window


def wave_parser(description: str) -> argparse.ArgumentParser:
    """The options of a per-wave report of a bench/constrained_tbt.py run (`result_rows`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", type=Path, required=True, help="bench/constrained_tbt.py --json output")
    parser.add_argument("--batch", type=int, default=None, help="only this batch size")
    return parser


def main() -> None:
    parser = wave_parser(__doc__)
    parser.add_argument("--steps", type=Path, required=True, help="the server's LLGTRT_STEP_LOG file")
    args = parser.parse_args()
    steps = read_steps(args.steps)
    for row in result_rows(args.result, args.batch):
        names: list[str] = []
        lines = []
        for kind, index, wave in waves(row):
            summary = wave_summary(steps, wave["started"], wave["ended"])
            names += [n for n in summary["phases_ms"] if n not in names]
            lines.append((f"{kind[:5]} {index}", summary))
        print(f"\nbatch {row['batch']}: per wave")
        print("| wave | s | steps | prefill steps | prompt tokens | prefill ms | riders | decode step p50 ms | "
              "last join s | admission ms | steady step p50 ms | sat out | straggler steps | "
              + " | ".join(f"{n} ms" for n in names) + " |")
        print("| --- |" + " ---: |" * (12 + len(names)))
        for label, s in lines:
            print(f"| {label} | {s['seconds']:.2f} | {s['steps']} | {s['prefill_steps']} | {s['prefill_tokens']} | "
                  f"{s['prefill_ms']:.0f} | {s['riders']} | {s['decode_step_ms_p50']:.2f} | {s['last_join_s']:.3f} | "
                  f"{s['admission_ms']:.0f} | {s['steady_step_ms_p50']:.2f} | {s['sat_out']} | {s['straggler_steps']} | "
                  + " | ".join(f"{s['phases_ms'].get(n, 0.0):.0f}" for n in names) + " |")
        print(f"\nbatch {row['batch']}: decode-only steps of all waves, wall ms")
        print("| kind | steps | p50 | mean | p90 | p99 | fill wait mean | waited > 1 ms | steps > 2x p50 | "
              "their GC ms | their preemptions |")
        print("| --- |" + " ---: |" * 10)
        for kind in ("unconstrained", "constrained"):
            mine = [s for k, _, wave in waves(row) if k == kind for s in steps_in(steps, wave["started"], wave["ended"])]
            t = tail_summary(mine)
            if t["steps"]:
                gc_ms = "-" if t["slow_gc_ms"] is None else f"{t['slow_gc_ms']:.0f}"
                preempted = "-" if t["slow_preempted"] is None else str(t["slow_preempted"])
                print(f"| {kind} | {t['steps']} | {t['p50']:.2f} | {t['mean']:.2f} | {t['p90']:.2f} | {t['p99']:.2f} | "
                      f"{t['fill_wait_mean']:.2f} | {t['waited_over_1ms']:.0%} | {t['slow_steps']} | {gc_ms} | "
                      f"{preempted} |")


if __name__ == "__main__":
    main()
