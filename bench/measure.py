"""What the benchmarks share: the GPU's copy bandwidth, one percentile rule, the machine line, where
a window's CPU time went on the host."""

from __future__ import annotations

import os
import platform
import time

import psutil
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


def cpu_model() -> str:
    """The host CPU's model name: hosts of one GPU kind differ in it, and host-bound results with it."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The host a result came from: name, CPU model and count, Python, load average."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{platform.node()}, {cpu_model()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, load average {load}")


# The server's processes by a word of their command line; the rest are this benchmark's own (it and
# the processes it started) or other.
_SERVER_ROLES = (("engine", "llgtrt_core.engine.core_process"), ("api", "_bentoml_impl"), ("api", "bentoml serve"))


def _role(process: psutil.Process, me: int) -> str:
    command = " ".join(process.info["cmdline"] or ())
    role = next((role for role, word in _SERVER_ROLES if word in command), None)
    if role is not None:
        return role
    return "client" if me in (process.pid, process.info["ppid"]) else "other"


def host_cpu() -> dict[str, object]:
    """A snapshot for `cpu_used`: the host's busy CPU seconds and every process's, with its role."""
    times = psutil.cpu_times()
    me = os.getpid()
    processes = {}
    for process in psutil.process_iter(["cmdline", "ppid", "cpu_times"]):
        cpu = process.info["cpu_times"]
        if cpu is not None:
            processes[process.pid] = (_role(process, me), cpu.user + cpu.system)
    steal = getattr(times, "steal", 0.0)
    return {"at": time.monotonic(), "busy": sum(times) - times.idle - getattr(times, "iowait", 0.0) - steal,
            "steal": steal, "processes": processes}


def cpu_used(before: dict[str, object], after: dict[str, object]) -> dict[str, float]:
    """Cores' worth of CPU between two `host_cpu` snapshots: the whole host's (`cores_busy`, of
    os.cpu_count()) and by role (engine process, API workers, this benchmark's clients, other): a
    host out of cores shows there, not in the engine's own phases. `steal`: cores' worth of time a
    virtual machine's CPUs waited for the hypervisor (a busy neighbour slows every phase alike)."""
    seconds = after["at"] - before["at"]
    used = {"cores_busy": (after["busy"] - before["busy"]) / seconds,
            "steal": (after["steal"] - before["steal"]) / seconds}
    for pid, (role, cpu) in after["processes"].items():
        used[role] = used.get(role, 0.0) + (cpu - before["processes"].get(pid, (role, 0.0))[1]) / seconds
    return used
