"""While the CPU decode step compiles (engine/compiled_decode.py), torch.fx's traces and the engine
thread's eager steps exclude each other (TRACING): a trace patches torch.nn.Module's __call__ and
__getattr__ for every thread while it runs, so a step meanwhile had its modules traced too."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.fx._symbolic_trace import Tracer

from llgtrt_core.engine.compiled_decode import TRACING, hold_tracing_lock


class PausedInTrace(torch.nn.Module):
    """Traced by torch.fx on a thread of its own: waits inside the trace until told to go on."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.go_on = threading.Event(), threading.Event()

    def forward(self, x):
        self.inside.set()
        self.go_on.wait(30)
        return x + 1


def test_a_step_under_the_lock_waits_for_a_trace_on_another_thread() -> None:
    hold_tracing_lock()
    hold_tracing_lock()  # once per process: a second call wraps nothing again
    assert Tracer.trace.holds_tracing_lock and not getattr(Tracer.trace.__wrapped__, "holds_tracing_lock", False)
    paused, linear, x = PausedInTrace(), torch.nn.Linear(4, 4), torch.randn(2, 4)
    want = linear(x)
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(paused,))
    tracer.start()
    try:
        assert paused.inside.wait(30)
        with pytest.raises(NameError):  # what the engine's eager step met: its module call traced too
            linear(x)
        got: list[torch.Tensor] = []

        def step() -> None:
            with TRACING:
                got.append(linear(x))

        stepper = threading.Thread(target=step)
        stepper.start()
        stepper.join(0.5)
        assert stepper.is_alive() and not got  # held off while the trace runs
    finally:
        paused.go_on.set()
        tracer.join(30)
    stepper.join(30)
    assert torch.equal(got[0], want)
