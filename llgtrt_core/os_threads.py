"""Names the OS sees for the threads on a step's path (`top -H`, `ps -L`, perf, and
bench/thread_pauses.py's `--threads`): before Python 3.14 every Python thread keeps the
interpreter's name ("python3"), and any thread takes the name of the thread that started it until
it names itself: llguidance's rayon pool (named here through the thread that starts it), a kernel's
helpers, a Python thread started lazily from a named one. Linux only; elsewhere these do nothing."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Iterator, Optional

_PR_SET_NAME, _PR_GET_NAME = 15, 16
_NAME_BYTES = 16  # the kernel's limit, the closing NUL included


def _prctl(option: int, name: ctypes.Array) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None).prctl(option, name, 0, 0, 0) == 0


def name_os_thread(name: str) -> None:
    """Name the calling thread (15 bytes kept); a ThreadPoolExecutor's `initializer` for its threads."""
    _prctl(_PR_SET_NAME, ctypes.create_string_buffer(name.encode()[:_NAME_BYTES - 1], _NAME_BYTES))


def os_thread_name() -> Optional[str]:
    """The calling thread's name, as the OS has it."""
    name = ctypes.create_string_buffer(_NAME_BYTES)
    return name.value.decode(errors="replace") if _prctl(_PR_GET_NAME, name) else None


@contextlib.contextmanager
def os_thread_named(name: str) -> Iterator[None]:
    """The calling thread named `name` meanwhile: native threads it starts keep the name."""
    before = os_thread_name()
    name_os_thread(name)
    try:
        yield
    finally:
        if before is not None:
            name_os_thread(before)
