"""Whether the machine has cores to spare (Linux's /proc/stat; elsewhere: never).

An OpenMP team stalls at every op while one of its threads waits for a core another process
holds (a ~17 ms step took 1.9 s, docs/benchmarks/cpu.md session 12), so extra engine threads are
taken only while the machine's cores were idle enough over the last quarter second. A thread
samples /proc/stat four times a second (~30 us each): a window measured at the step's start
would be long ago after an idle pause, and blind to a process that started since.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

STAT_PATH = "/proc/stat"
# Of each extra thread's core, idle over the window: one stream's decode leaves ~0.5 core of 2
# idle (its API process and client take the rest, and wait for the first token when a prompt
# step runs); another process holding a core leaves ~none (docs/benchmarks/cpu.md, session 12).
IDLE_SHARE = 0.3


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
    the idle share of the last window (none measured yet: no)."""

    def __init__(self, cores: int, window_s: float = 0.25, stat_path: str = STAT_PATH) -> None:
        """cores: the machine's (/proc/stat counts them all); window_s: the sampling period (the
        kernel counts in 10 ms ticks)."""
        self.cores = cores
        self.window_s = window_s
        self.stat_path = stat_path
        self._idle_cores = 0.0
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        first = read_cpu_jiffies(self.stat_path)
        if self._thread is None and first is not None:
            self._thread = threading.Thread(target=self._sample, args=(first,), name="idle-cores", daemon=True)
            self._thread.start()

    def spare(self, extra: int) -> bool:
        return self._idle_cores >= IDLE_SHARE * extra

    def _sample(self, before: tuple[int, int]) -> None:
        while True:
            time.sleep(self.window_s)
            now = read_cpu_jiffies(self.stat_path)
            if now is None or now[1] <= before[1]:  # a torn read, or no tick since
                continue
            self._idle_cores = self.cores * (now[0] - before[0]) / (now[1] - before[1])
            before = now
