"""Which threads of the engine process run, and how often each stops, wave by wave.

`sample` reads every thread of a process (`/proc/PID/task`) every --interval seconds: CPU ticks,
voluntary context switches (the thread blocked: on the GIL, a lock, a device sync) and involuntary
ones (the kernel took its core away), stamped with time.perf_counter() (CLOCK_MONOTONIC, the clock
of `constrained_tbt.py`'s wave windows), as JSON lines, until the process ends or the sampler is
stopped. `waves` then gives, per wave of a `constrained_tbt.py --json` file, the engine thread's
(the thread with the most CPU over the run) share of a core and its switches a step, and the
other threads' together: whether a constrained wave's engine thread waits more (voluntary) or is
preempted more (involuntary) than an unconstrained one's.

    python3 bench/thread_switches.py sample --pid $(pgrep -f llgtrt_core.engine.core_process) --out t.jsonl &
    python3 bench/constrained_tbt.py --url ... --batch 128,256 --rounds 3 --json tbt.json
    kill %1; python3 bench/thread_switches.py waves --samples t.jsonl --tbt tbt.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def read_threads(pid: int) -> dict[str, list[int]]:
    """Per thread id: [CPU ticks (user + system), voluntary switches, involuntary switches]."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
        switches = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line}
        threads[tid] = [int(fields[11]) + int(fields[12]), switches["voluntary_ctxt_switches"],
                        switches["nonvoluntary_ctxt_switches"]]
    return threads


def sample(pid: int, out: Path, interval: float) -> None:
    with out.open("w") as f:
        while os.path.exists(f"/proc/{pid}"):
            f.write(json.dumps({"t": time.perf_counter(), "threads": read_threads(pid)}) + "\n")
            f.flush()
            time.sleep(interval)


def waves(samples_path: Path, tbt_path: Path) -> None:
    samples = [json.loads(line) for line in samples_path.open()]
    first, last = samples[0]["threads"], samples[-1]["threads"]
    engine = max(last, key=lambda tid: last[tid][0] - first.get(tid, [0])[0])

    def nearest(t: float) -> dict:
        return min(samples, key=lambda s: abs(s["t"] - t))

    print("wave | seconds | steps | engine thread: core share, voluntary / involuntary switches a step | "
          "other threads: cores, voluntary / involuntary a step")
    per_kind: dict[str, list[float]] = {}
    for row in json.loads(tbt_path.read_text())["rows"]:
        for kind in ("unconstrained", "constrained"):
            for index, wave in enumerate(row["engine_by_round"][kind]):
                a, b = nearest(wave["started"]), nearest(wave["ended"])
                seconds, steps = b["t"] - a["t"], wave.get("steps") or 0
                if seconds <= 0 or not steps:
                    continue

                def delta(tid: str, k: int) -> int:
                    return b["threads"].get(tid, [0, 0, 0])[k] - a["threads"].get(tid, [0, 0, 0])[k]

                others = [tid for tid in b["threads"] if tid != engine]
                engine_voluntary = delta(engine, 1) / steps
                per_kind.setdefault(f"batch {row['batch']} {kind}", []).append(engine_voluntary)
                print(f"batch {row['batch']} {kind} {index + 1} | {seconds:.2f} | {steps} | "
                      f"{delta(engine, 0) / TICKS_PER_S / seconds:.2f}, {engine_voluntary:.1f} / {delta(engine, 2) / steps:.2f} | "
                      f"{sum(delta(t, 0) for t in others) / TICKS_PER_S / seconds:.2f}, "
                      f"{sum(delta(t, 1) for t in others) / steps:.0f} / {sum(delta(t, 2) for t in others) / steps:.0f}")
    for name, values in per_kind.items():
        print(f"{name}: the engine thread's voluntary switches a step, median {statistics.median(values):.1f} "
              f"(range {min(values):.1f}-{max(values):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("sample")
    run.add_argument("--pid", type=int, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--interval", type=float, default=0.2)
    report = commands.add_parser("waves")
    report.add_argument("--samples", type=Path, required=True)
    report.add_argument("--tbt", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "sample":
        sample(args.pid, args.out, args.interval)
    else:
        waves(args.samples, args.tbt)


if __name__ == "__main__":
    main()
