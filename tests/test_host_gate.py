"""HostGate: work queued behind a wait starts only once a host thread opens its ticket, and reads
the host memory written before the opening (what the mask fill writes before the draw's copy)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from llgtrt_core.kernels.host_gate import HostGate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_copy_behind_a_wait_reads_what_the_host_wrote_before_opening_the_gate() -> None:
    device = torch.device("cuda")
    gate = HostGate.create(device)
    assert gate is not None  # the H100/H200 drivers take cuStreamWaitValue32
    stream = torch.cuda.Stream(device)
    host = torch.zeros(1 << 20, dtype=torch.int32, pin_memory=True)
    on_device = torch.empty_like(host, device=device)
    for value in (1, 2, 3):  # tickets in turn, each waited for while still closed
        ticket = gate.ticket()
        with torch.cuda.stream(stream):
            gate.wait(stream, ticket)
            on_device.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        time.sleep(0.05)
        assert not done.query()  # the stream waits: nothing copied yet

        def fill_then_open() -> None:  # as the mask fill's thread: write, then open
            host.fill_(value)
            gate.open(ticket)

        threading.Thread(target=fill_then_open).start()
        done.synchronize()
        assert bool((on_device == value).all())


def test_an_opened_ticket_lets_waits_for_earlier_ones_through_at_once() -> None:
    device = torch.device("cuda")
    gate = HostGate.create(device)
    first, second = gate.ticket(), gate.ticket()
    gate.open(second)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        gate.wait(stream, first)
        gate.wait(stream, second)
        done = torch.cuda.Event()
        done.record(stream)
    deadline = time.monotonic() + 5
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    passed = done.query()
    gate.open(gate.ticket())  # a stuck stream would hold the process at its exit
    assert passed
