"""Graceful shutdown: on SIGTERM the worker drains before uvicorn stops it.

uvicorn, told to exit, stops accepting at once (new connections then hang in the listening socket
the BentoML arbiter holds) and, at its graceful-shutdown timeout, cancels what still runs (a stream
then ends with no final event). So SIGTERM first only starts draining: /readyz answers 503 and every
new request to a protected route 503 at once, while generation requests in flight go on. Once they
have ended, or at uvicorn's graceful-shutdown timeout, the streams still running end with an error
event and [DONE] (`cut`), and only then is uvicorn's own SIGTERM handler run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any, Callable, Iterator, Optional

logger = logging.getLogger(__name__)

CUT_GRACE_S = 2.0  # for cut streams to send their last event before uvicorn takes over
POLL_S = 0.05


class Shutdown:
    def __init__(self) -> None:
        self.draining = False  # SIGTERM received: refuse new work, report not ready
        self.cut = False  # the deadline passed: streams end now, with an error event
        self.num_active = 0  # generation requests in flight

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        self.num_active += 1
        try:
            yield
        finally:
            self.num_active -= 1

    async def drain(self, timeout_s: Optional[float], then: Callable[[], None]) -> None:
        """Wait for generation requests in flight to end (at most `timeout_s`; None: as long as they
        run), cut the rest, then call `then`."""
        self.draining = True
        logger.info("draining: %d generation request(s) in flight", self.num_active)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.num_active and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(POLL_S)
        if self.num_active:
            logger.info("graceful shutdown timeout: cutting %d generation request(s)", self.num_active)
            self.cut = True
            grace_end = time.monotonic() + CUT_GRACE_S
            while self.num_active and time.monotonic() < grace_end:
                await asyncio.sleep(POLL_S)
        then()


SHUTDOWN = Shutdown()  # one per worker process, like its event loop


def drain_on_sigterm(shutdown: Shutdown = SHUTDOWN) -> None:
    """Put draining in front of the SIGTERM handler uvicorn installed (call from the running loop,
    at startup). The graceful-shutdown timeout is uvicorn's own (`--timeout-graceful-shutdown`)."""
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)
    server_config: Any = getattr(getattr(previous, "__self__", None), "config", None)
    timeout_s = getattr(server_config, "timeout_graceful_shutdown", None)

    def hand_over() -> None:
        if callable(previous):
            previous(signal.SIGTERM, None)

    def on_sigterm(signum: int, frame: Any) -> None:
        if shutdown.draining:
            return  # the arbiter forwards the signal the process group already got
        shutdown.draining = True
        loop.call_soon_threadsafe(lambda: loop.create_task(shutdown.drain(timeout_s, hand_over)))

    signal.signal(signal.SIGTERM, on_sigterm)
