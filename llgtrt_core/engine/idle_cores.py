"""Whether the machine has cores to spare (Linux's /proc/stat; elsewhere: never).

An OpenMP team stalls at every op while one of its threads waits for a core another process
holds (a ~17 ms step took 1.9 s, docs/benchmarks/cpu.md session 12), so extra engine threads are
taken only while other processes kept little of the machine busy over the last quarter second.
A thread samples /proc/stat four times a second (~30 us each): a window measured at the step's
start would reach back across an idle pause, blind to a process started since.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

STAT_PATH = "/proc/stat"
# Of the cores the team needs (the caller's and the extra ones), how much other processes may have
# kept busy over the window: one stream's API process and client take ~0.5 core (and wait for
# the first token when a prompt step runs); another process holding a core takes ~1
# (docs/benchmarks/cpu.md, session 12).
OTHERS_MAX_CORES = 0.7


def read_cpu_jiffies(path: str = STAT_PATH) -> Optional[tuple[int, int]]:
    """(idle, total) jiffies of all cores since boot (idle includes iowait); None without /proc."""
    try:
        with open(path) as stat:
            fields = [int(field) for field in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    return fields[3] + fields[4], sum(fields[:8])  # guest time is counted in user already


class IdleCores:
    """`spare(extra)`: whether `extra` more threads than the caller's would find idle cores, from
    what other processes kept busy over the last window (none measured yet: no)."""

    def __init__(self, cores: int, window_s: float = 0.25, stat_path: str = STAT_PATH) -> None:
        """cores: the machine's (/proc/stat counts them all); window_s: the sampling period (the
        kernel counts in 10 ms ticks)."""
        self.cores = cores
        self.window_s = window_s
        self.stat_path = stat_path
        self._others_busy = float(cores)  # cores other processes kept busy over the last window
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        first = read_cpu_jiffies(self.stat_path)
        if self._thread is None and first is not None:
            started = (time.monotonic(), time.process_time(), *first)
            self._thread = threading.Thread(target=self._sample, args=(started,), name="idle-cores", daemon=True)
            self._thread.start()

    def spare(self, extra: int) -> bool:
        return self._others_busy <= self.cores - 1 - extra + OTHERS_MAX_CORES

    def _sample(self, before: tuple[float, float, int, int]) -> None:
        """(wall s, process cpu s, idle, total jiffies) each window: the machine's busy cores less
        this process's own (its engine thread is the caller, busy or not)."""
        while True:
            time.sleep(self.window_s)
            jiffies = read_cpu_jiffies(self.stat_path)
            if jiffies is None or jiffies[1] <= before[3]:  # a torn read, or no tick since
                continue
            now = (time.monotonic(), time.process_time(), *jiffies)
            busy = self.cores * (1 - (now[2] - before[2]) / (now[3] - before[3]))
            self._others_busy = busy - (now[1] - before[1]) / (now[0] - before[0])
            before = now
