"""llgtrt_core/os_threads.py: the names the OS sees for the threads on a step's path, among them
llguidance's own (real llguidance), which take the name of the thread that started them."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from llgtrt_core.constraints.postprocessor import MaskPool
from llgtrt_core.os_threads import name_os_thread, os_thread_name, os_thread_named

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names through prctl: Linux")


def names() -> list[str]:
    """The OS's name of every thread of this process."""
    tasks = f"/proc/{os.getpid()}/task"
    return [open(f"{tasks}/{tid}/comm").read().strip() for tid in os.listdir(tasks)]


def test_names_the_calling_thread_cut_to_fifteen_bytes() -> None:
    seen: list[str] = []

    def named() -> None:
        name_os_thread("a-thread-name-longer-than-fifteen")
        seen.extend([os_thread_name() or "", *names()])

    thread = threading.Thread(target=named)
    thread.start()
    thread.join()
    assert seen[0] == "a-thread-name-l"
    assert "a-thread-name-l" in seen[1:]


def test_named_meanwhile_then_as_before() -> None:
    before = os_thread_name()
    with os_thread_named("meanwhile"):
        assert os_thread_name() == "meanwhile"
    assert os_thread_name() == before


def test_a_mask_pools_llguidance_threads_carry_its_name() -> None:
    pool = MaskPool(3, "llg-test-pool")
    pool.beside.submit(lambda: None).result()  # starts the loop guards' thread
    assert names().count("llg-test-pool") >= 3
    assert "loop-guard" in names()
    assert os_thread_name() != "llg-test-pool"  # the constructing thread got its name back
    pool.beside.shutdown()
