"""Where a thread's time goes, phase by phase: wall time and the thread's own CPU time.

The engine marks the end of each phase of its step loop; the difference between a phase's wall
and CPU time is time the thread did not run: waiting for the GPU, for another thread (the mask
fill), or for the GIL while another thread of the process held it. Two clock reads per mark
(~1 us), so it stays on; /v1/engine/stats reports the totals and bench/step_profile.py the
per-step means of a window. LLGTRT_STEP_LOG=<path> also writes one JSON line per step (what it
ran, each phase's wall ms, and what stalled the whole step: `StepLog`): the steps of one wave of
requests, which means over a window hide.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class PhaseTotals:
    count: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # of the thread that marked it


class StepPhases:
    """Totals per phase for one thread. `begin` starts a span, each `mark(phase)` ends the phase
    running since the last mark; a thread's spans never overlap."""

    def __init__(self, trace: "StepTrace | None" = None, log: "StepLog | None" = None) -> None:
        self.totals: dict[str, PhaseTotals] = {}
        self._wall = self._cpu = 0.0
        self.trace = trace
        self.log = log
        self._step: dict[str, float] = {}  # this step's phases, wall ms, when logging

    def begin(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def mark(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self.add(phase, wall - self._wall, cpu - self._cpu)
        if self.log is not None:
            self._step[phase] = self._step.get(phase, 0.0) + (wall - self._wall) * 1e3
        self._wall, self._cpu = wall, cpu
        if self.trace is not None:
            self.trace.phase_ended(phase)

    def add(self, phase: str, wall_s: float, cpu_s: float = 0.0) -> None:
        """One span of `phase` into its totals: `mark`'s, or one timed elsewhere (another process:
        perf_counter is the machine's monotonic clock), its wall time only."""
        totals = self.totals.get(phase)
        if totals is None:
            totals = self.totals[phase] = PhaseTotals()
        totals.count += 1
        totals.wall_s += wall_s
        totals.cpu_s += cpu_s

    def end_step(self, record: dict[str, object]) -> None:
        """With a log: write `record` (what the step ran) with its phases' wall ms."""
        if self.log is not None:
            self.log.write({**record, "ended": time.perf_counter(), "ms": self._step})
            self._step = {}

    def snapshot(self, prefix: str = "") -> dict[str, dict[str, float]]:
        return {prefix + name: {"count": t.count, "wall_s": t.wall_s, "cpu_s": t.cpu_s}
                for name, t in self.totals.items()}


@dataclass
class Pauses:
    count: int = 0
    total_ms: float = 0.0
    longest_ms: float = 0.0


class GcPauses:
    """The garbage collector's pauses from its creation on, per generation: a collection holds the
    GIL, so it stalls every thread of the process. Totals only: a server runs for days."""

    def __init__(self) -> None:
        self.by_generation: dict[int, Pauses] = {}
        self._started: float | None = None
        gc.callbacks.append(self._on_gc)

    def total_ms(self) -> float:
        return sum(pauses.total_ms for pauses in self.by_generation.values())

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            ms = (now - self._started) * 1e3
            pauses = self.by_generation.setdefault(info["generation"], Pauses())
            pauses.count += 1
            pauses.total_ms += ms
            pauses.longest_ms = max(pauses.longest_ms, ms)
            self._started = None


class StepLog:
    """Appends one JSON object per line to a file, a line at a time (the process may end any time).
    Each line also says what stalled every phase of the step alike: `gc_ms`, the garbage
    collector's pauses during it (any thread's collection holds the GIL), and `preempted`, the times
    the OS took the core from the writing thread (its involuntary context switches; Linux)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)
        self._gc = GcPauses()
        self._gc_ms = 0.0  # the collector's total at the last line
        self._preemptions: int | None = None  # the writing thread's at its last line (the first line: null)

    @classmethod
    def from_env(cls) -> "StepLog | None":
        path = os.environ.get("LLGTRT_STEP_LOG")
        return cls(path) if path else None

    def write(self, record: dict[str, object]) -> None:
        preemptions, before = _preemptions(), self._preemptions
        preempted = None if preemptions is None or before is None else preemptions - before
        gc_ms = self._gc.total_ms()
        stalls = {"gc_ms": gc_ms - self._gc_ms, "preempted": preempted}
        self._gc_ms, self._preemptions = gc_ms, preemptions
        self._file.write(json.dumps({**record, **stalls}) + "\n")


def _preemptions() -> int | None:
    """The calling thread's involuntary context switches so far (None where the OS does not say)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
    except (ImportError, AttributeError, OSError):
        return None


class StepTrace:
    """A torch.profiler trace (CPU and CUDA) of a window of engine steps, asked for with
    LLGTRT_STEP_TRACE="<dir>,<first step>,<steps>": the GPU's timeline under real load (idle gaps
    between kernels, host launches), which the phase totals cannot show. Written once, as
    <dir>/steps-<first>-<last>.json (Chrome trace) and .txt (the top kernels and ops)."""

    def __init__(self, spec: str) -> None:
        directory, first, steps = spec.split(",")
        self.directory, self.first, self.last = directory, int(first), int(first) + int(steps)
        self._profiler = None
        self._step_range = None  # the running step's range in the trace
        self._phase_range = None  # from the last phase's end: named "after <phase>"

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        spec = os.environ.get("LLGTRT_STEP_TRACE")
        return cls(spec) if spec else None

    def at_step(self, step: int) -> None:
        """Called as each step begins: starts and ends the window, and marks the steps in it."""
        self._phase_range = _exit(self._phase_range)
        self._step_range = _exit(self._step_range)
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.__enter__()
        elif step == self.last and self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            stem = Path(self.directory) / f"steps-{self.first}-{self.last}"
            stem.parent.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(f"{stem}.json")
            stem.with_suffix(".txt").write_text(
                self._profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
            self._profiler = None
        if self._profiler is not None:
            self._step_range = _enter(f"step {step}")

    def phase_ended(self, phase: str) -> None:
        if self._profiler is not None and self._step_range is not None:
            _exit(self._phase_range)
            self._phase_range = _enter(f"after {phase}")


def _enter(name: str):
    from torch.profiler import record_function

    scope = record_function(name)
    scope.__enter__()
    return scope


def _exit(scope) -> None:
    if scope is not None:
        scope.__exit__(None, None, None)
