"""What the benchmarks share: the GPU's copy bandwidth, one percentile rule, the machine line."""

from __future__ import annotations

import os
import platform

import torch


def copy_bandwidth(gib: int = 4, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (median of repeats)."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / sorted(times[3:])[repeats // 2]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def machine() -> str:
    """The host a result came from: name, CPUs, Python, load average."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, load average {load}")
