"""How many threads share a CPU step's quantized matmuls (kernels/cpu_quant.py): every core while
other processes leave them idle (`IdleCores`), else the engine thread alone.

The kernels' helper threads claim chunks of a matmul as they get to them, so a helper the OS
delays costs at most the chunk it holds (an OpenMP team waits at each op for its slowest thread).
They spin between matmuls for ~0.1 ms, though, taking a core the API process or another program
could use: so they join only while the cores are otherwise idle.
"""

from __future__ import annotations

import os

from llgtrt_core.engine.idle_cores import IdleCores
from llgtrt_core.kernels import cpu_quant


class KernelThreads:
    def __init__(self, threads: int):
        """threads: the most that share a step's matmuls (the engine thread and threads - 1 helpers)."""
        self.threads = threads
        self.idle_cores = IdleCores(os.cpu_count() or 1)
        self.num_shared_steps = 0  # steps whose matmuls ran on more than one thread (/v1/engine/stats)
        self._now = 1

    def start(self) -> None:
        if self.threads > 1:
            self.idle_cores.start()

    def before_step(self) -> None:
        """Set the threads of the step about to run."""
        threads = self.threads if self.threads > 1 and self.idle_cores.spare(self.threads - 1) else 1
        if threads != self._now:
            cpu_quant.set_threads(threads)
            self._now = threads
        self.num_shared_steps += threads > 1
