"""Where a thread's time goes, phase by phase: wall time and the thread's own CPU time.

The engine marks the end of each phase of its step loop; the difference between a phase's wall
and CPU time is time the thread did not run: waiting for the GPU, for another thread (the mask
fill), or for the GIL while another thread of the process held it. Two clock reads per mark
(~1 us), so it stays on; /v1/engine/stats reports the totals and bench/step_profile.py the
per-step means of a window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class PhaseTotals:
    count: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # of the thread that marked it


class StepPhases:
    """Totals per phase for one thread. `begin` starts a span, each `mark(phase)` ends the phase
    running since the last mark; a thread's spans never overlap."""

    def __init__(self) -> None:
        self.totals: dict[str, PhaseTotals] = {}
        self._wall = self._cpu = 0.0

    def begin(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def mark(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        totals = self.totals.get(phase)
        if totals is None:
            totals = self.totals[phase] = PhaseTotals()
        totals.count += 1
        totals.wall_s += wall - self._wall
        totals.cpu_s += cpu - self._cpu
        self._wall, self._cpu = wall, cpu

    def snapshot(self, prefix: str = "") -> dict[str, dict[str, float]]:
        return {prefix + name: {"count": t.count, "wall_s": t.wall_s, "cpu_s": t.cpu_s}
                for name, t in self.totals.items()}
