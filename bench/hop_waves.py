"""Each wave of a bench/constrained_tbt.py run, read from a hop log (bench/hop_log/sitecustomize.py):
when its requests were planned and handed to the engine process, and which pauses fell inside it.

    python3 bench/hop_waves.py --hops $HOP_DIR --result ctbt.json [--batch 256]

Per wave (times from the client jobs' common start, ms): the API workers' planning starts
(p10/50/90/max) and each worker's share and span, "add" sent and received, the last submit; then
every garbage collection of 10 ms or more and every event-loop or thread lag of 20 ms or more in a
server process, with the process and when.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wave_steps import result_rows, wave_parser, waves  # noqa: E402


def read_hops(folder: Path) -> list[dict[str, Any]]:
    """Every event, tagged with its process's role: api<pid>, engine, client or other."""
    events = []
    for path in sorted(folder.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            continue
        command = lines[0].get("cmd", "")
        role = (f"api{path.stem}" if "worker.service" in command else "engine" if "core_process" in command
                else "client" if "spawn_main" in command else "other")
        for event in lines:
            event["role"] = role
        events += lines
    return events


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def wave_lines(events: list[dict[str, Any]], started: float, ended: float) -> list[str]:
    starts = [e["start_at"] for e in events if e["k"] == "client_job" and started <= e["start_at"] <= ended]
    if not starts:
        return ["  (no client job in this window)"]
    t0 = min(starts)
    mine = [e for e in events if t0 - 0.05 <= e["t"] <= ended]

    def at(kind: str, role: str = "") -> list[float]:
        return [(e["t"] - t0) * 1e3 for e in mine if e["k"] == kind and e["role"].startswith(role)]

    planned, sent, received, submitted = at("plan_start"), at("add_sent"), at("add_recv"), at("submit")
    lines = [f"  planned p10/50/90/max {quantile(planned, .1):.0f}/{quantile(planned, .5):.0f}/"
             f"{quantile(planned, .9):.0f}/{max(planned, default=float('nan')):.0f}, add sent p50/max "
             f"{quantile(sent, .5):.0f}/{max(sent, default=float('nan')):.0f}, received p50/max "
             f"{quantile(received, .5):.0f}/{max(received, default=float('nan')):.0f}, last submit "
             f"{max(submitted, default=float('nan')):.0f}"]
    for role in sorted({e["role"] for e in mine if e["k"] == "plan_start"}):
        times = sorted(at("plan_start", role))
        gaps = [f"{a:.0f}->{b:.0f}" for a, b in zip(times, times[1:]) if b - a > 50]
        lines.append(f"  {role}: {len(times)} planned over {times[0]:.0f}-{times[-1]:.0f}"
                     + (f", gaps over 50 ms: {' '.join(gaps)}" if gaps else ""))
    pauses = [f"{e['role']} {e['k']} {e['ms']:.0f} ms at {(e['t'] - t0) * 1e3:.0f}" for e in mine
              if e["role"] not in ("client", "other") and (
                  (e["k"] == "gc" and e["ms"] >= 10) or (e["k"] in ("loop_lag", "thread_lag") and e["ms"] >= 20))]
    if pauses:
        lines.append("  pauses: " + "; ".join(pauses))
    return lines


def main() -> None:
    parser = wave_parser(__doc__)
    parser.add_argument("--hops", type=Path, required=True, help="the HOP_DIR folder")
    args = parser.parse_args()
    events = read_hops(args.hops)
    for row in result_rows(args.result, args.batch):
        for kind, index, window in waves(row):
            print(f"batch {row['batch']}, {kind} wave {index}")
            print("\n".join(wave_lines(events, window["started"], window["ended"])))


if __name__ == "__main__":
    main()
