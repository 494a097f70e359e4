"""Whether the machine has cores to spare (Linux's /proc/stat; elsewhere: never).

An OpenMP team stalls at every op while one of its threads waits for a core another process
holds (a step of ~20 ms took seconds, docs/benchmarks/cpu.md), so extra engine threads are taken
only while the machine's cores have been idle enough lately.
"""

from __future__ import annotations

import time
from typing import Optional

STAT_PATH = "/proc/stat"
# Of each extra thread's core, idle on average since the last look: one stream's decode leaves
# ~0.5 core of 2 idle (its API process and client take the rest, and wait for the first token
# when a prompt step runs); another process holding a core leaves ~none (docs/benchmarks/cpu.md).
IDLE_SHARE = 0.3


def read_cpu_jiffies(path: str = STAT_PATH) -> Optional[tuple[int, int]]:
    """(idle, total) jiffies of all cores since boot (idle includes iowait); None without /proc."""
    try:
        with open(path) as stat:
            fields = [int(field) for field in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields[:8])  # guest time is counted in user already


class IdleCores:
    """`spare(extra)`: whether `extra` more threads than the caller's would find idle cores."""

    def __init__(self, cores: int, window_s: float = 0.25, stat_path: str = STAT_PATH) -> None:
        """cores: the machine's (/proc/stat counts them all). The idle share is measured since the
        last look at least `window_s` ago (the kernel counts in 10 ms ticks); this one is the first."""
        self.cores = cores
        self.window_s = window_s
        self.stat_path = stat_path
        self._since = (time.monotonic(), read_cpu_jiffies(stat_path))
        self._idle_cores = 0.0

    def spare(self, extra: int) -> bool:
        now, jiffies = time.monotonic(), read_cpu_jiffies(self.stat_path)
        since, before = self._since
        if jiffies is None or before is None:
            return False
        if now - since >= self.window_s and jiffies[1] > before[1]:
            self._idle_cores = self.cores * (jiffies[0] - before[0]) / (jiffies[1] - before[1])
            self._since = (now, jiffies)
        return self._idle_cores >= IDLE_SHARE * extra
