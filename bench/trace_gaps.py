"""Where the GPU idles in a window of engine steps, from a trace the engine wrote under load.

Start the server with LLGTRT_STEP_TRACE="<dir>,<first step>,<steps>" (llgtrt_core/engine/step_profile.py),
put it under load (bench/http_load.py), then:

    python3 bench/trace_gaps.py <dir>/steps-<first>-<last>.json [--json out.json]

Per step (the engine thread's "step N" range): wall time, the GPU's busy time (the union of its
kernels, copies and sets), its idle time, kernel time launched from CUDA graphs and eagerly;
per host phase (the ranges "after <phase>", i.e. the phase that follows it): the host's time and the
GPU idle time that began while the host was in it. Means and ranges over the steps.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
from typing import Any

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
MIN_GAP_US = 5.0  # gaps shorter than this are launch latency between back-to-back kernels


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy_within(busy: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in busy)


def analyse(events: list[dict[str, Any]]) -> dict[str, Any]:
    spans = [e for e in events if e.get("ph") == "X"]
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]
    launches = {e["args"].get("correlation"): e["name"] for e in spans if e.get("cat") == "cuda_runtime"}
    busy = merge([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    annotations = [e for e in spans if e.get("cat") == "user_annotation"]
    steps = sorted((e for e in annotations if e["name"].startswith("step ")), key=lambda e: e["ts"])
    phases = sorted((e for e in annotations if e["name"].startswith("after ")), key=lambda e: e["ts"])
    phase_starts = [p["ts"] for p in phases]
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1) if busy[i + 1][0] - busy[i][1] >= MIN_GAP_US]

    per_step = []
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        kernels = [e for e in gpu if start <= e["ts"] < end]
        launched = collections.Counter()
        for e in kernels:
            via = launches.get(e["args"].get("correlation"), "?")
            launched["graph" if via == "cudaGraphLaunch" else e["cat"] if e["cat"] != "kernel" else "eager"] += e["dur"]
        busy_us = busy_within(busy, start, end)
        per_step.append({"step": step["name"], "wall_us": end - start, "gpu_busy_us": busy_us,
                         "gpu_idle_us": end - start - busy_us, **{f"{k}_us": v for k, v in launched.items()}})

    host = collections.defaultdict(list)
    for p in phases:
        host[p["name"]].append(p["dur"])
    idle_in = collections.defaultdict(float)
    for gap_start, gap_end in gaps:
        i = bisect.bisect_right(phase_starts, gap_start) - 1
        name = phases[i]["name"] if i >= 0 and gap_start < phases[i]["ts"] + phases[i]["dur"] else "(outside a step)"
        idle_in[name] += gap_end - gap_start
    return {"steps": per_step, "host_phases_us": {k: summary(v) for k, v in host.items()},
            "gpu_idle_started_in_us_per_step": {k: v / max(1, len(steps)) for k, v in idle_in.items()},
            "top_kernels": top_kernels(gpu)}


def top_kernels(gpu: list[dict[str, Any]], count: int = 15) -> list[tuple[str, float, int]]:
    totals: dict[str, list[float]] = collections.defaultdict(list)
    for e in gpu:
        totals[e["name"][:90]].append(e["dur"])
    ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:count]
    return [(name, sum(durs), len(durs)) for name, durs in ranked]


def summary(values: list[float]) -> dict[str, float]:
    return {"count": len(values), "mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--json")
    args = parser.parse_args()
    with open(args.trace) as f:
        result = analyse(json.load(f)["traceEvents"])
    steps = result["steps"]
    keys = sorted({k for s in steps for k in s if k.endswith("_us")})
    print(f"{len(steps)} steps; per step, mean [min-max] in ms:")
    for key in keys:
        values = [s.get(key, 0.0) / 1e3 for s in steps]
        print(f"  {key[:-3]:>12}: {statistics.fmean(values):7.3f} [{min(values):.3f}-{max(values):.3f}]")
    print("host phases (range 'after X' = the phase after X), ms: mean [min-max] count")
    for name, s in result["host_phases_us"].items():
        idle = result["gpu_idle_started_in_us_per_step"].get(name, 0.0)
        print(f"  {name:>22}: {s['mean'] / 1e3:7.3f} [{s['min'] / 1e3:.3f}-{s['max'] / 1e3:.3f}] x{s['count']}"
              f"   GPU idle begun here {idle / 1e3:.3f} ms/step")
    outside = result["gpu_idle_started_in_us_per_step"].get("(outside a step)")
    if outside:
        print(f"  GPU idle begun outside the phases: {outside / 1e3:.3f} ms/step")
    print("top GPU work: total ms, count")
    for name, total, count in result["top_kernels"]:
        print(f"  {total / 1e3:9.3f} {count:6d}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
