"""Request limits: the body (size, 413; lone surrogates, 400) and admission of generation requests (429).

Generation requests take one place per sequence they ask for (prompts x choices) from the moment
they are planned (`admit`, called where every generation starts) until their response, streamed or
not, ends. Requests not yet holding their places, beyond those the free places will take, are the
queue: past `max_queued` of them, a request is refused at once with 429 and Retry-After, before its
body is read. Both are pure ASGI middlewares, so streaming and disconnect detection pass through untouched.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from typing import Optional

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llgtrt_core import metrics
from llgtrt_core.api.errors import error_body, error_type
from llgtrt_core.api.protocol import ErrorInfo
from llgtrt_core.api.text_check import lone_surrogate_param


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, reason: str,
                 headers: Optional[dict[str, str]] = None, param: Optional[str] = None) -> None:
    metrics.requests_rejected.labels(reason=reason).inc()
    body = error_body(ErrorInfo(message=message, type=error_type(status), param=param, code=reason))
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


class RequestBody:
    """Reads the body up front (requests are JSON the app reads whole anyway), refusing it past
    `max_bytes` (0: no limit) whatever Content-Length claims, and refusing text no tokenizer or
    JSON encoder takes (a lone UTF-16 surrogate) with a 400 naming the field; then replays it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if self.max_bytes and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if self.max_bytes and size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole = b"".join(chunks)
        param = lone_surrogate_param(whole)
        if param is not None:
            await refuse(scope, receive, send, 400, f"{param or 'the body'}: text must not hold a lone UTF-16 "
                         "surrogate (\\ud800-\\udfff without its pair)", "invalid_text", param=param or None)
            return
        body: Message | None = {"type": "http.request", "body": whole, "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # afterwards: the disconnect the app may wait for

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await refuse(scope, receive, send, 413, f"request body larger than {self.max_bytes} bytes", "too_large")


class Places:
    """A weighted, first-come-first-served semaphore: `capacity` places, a request takes several."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def available(self) -> int:
        """Places a request arriving now could take without waiting."""
        return 0 if self._waiters else self.free

    async def acquire(self, wanted: int) -> int:
        """Take `wanted` places (at most all of them, so every request can run); returns how many."""
        wanted = min(wanted, self.capacity)
        if not self._waiters and self.free >= wanted:
            self.free -= wanted
            return wanted
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (wanted, granted)
        self._waiters.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(wanted)  # granted just as the waiter was cancelled
            else:
                self._waiters.remove(entry)
                self._grant()  # the next waiter may fit now
            raise
        return wanted

    def release(self, count: int) -> None:
        self.free += count
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            wanted, granted = self._waiters.popleft()
            self.free -= wanted
            granted.set_result(None)


class Ticket:
    """One generation request's admission: holds nothing until `admit`, everything until the end."""

    def __init__(self, limit: "AdmissionLimit") -> None:
        self._limit = limit
        self._held = 0
        self._waiting = True
        limit.num_waiting += 1

    async def admit(self, sequences: int) -> None:
        places = self._limit.places
        if places is not None and not self._held:
            self._held = await places.acquire(sequences)
        self._stop_waiting()

    def release(self) -> None:
        self._stop_waiting()
        if self._held and self._limit.places is not None:
            self._limit.places.release(self._held)
            self._held = 0

    def _stop_waiting(self) -> None:
        if self._waiting:
            self._waiting = False
            self._limit.num_waiting -= 1


_current_ticket: contextvars.ContextVar[Optional[Ticket]] = contextvars.ContextVar("admission_ticket", default=None)


async def admit(sequences: int) -> None:
    """Wait for `sequences` places of the current request's admission (429 was decided earlier)."""
    ticket = _current_ticket.get()
    if ticket is None:  # a bug, found by the route's first test: no generation outside admission
        raise RuntimeError("generation outside admission: declare the route in api/app.py GENERATION_PATHS")
    await ticket.admit(sequences)


class AdmissionLimit:
    """Admission for generation requests; `max_concurrent` 0: no places to wait for (nor queue)."""

    def __init__(self, app: ASGIApp, max_concurrent: int, max_queued: int, retry_after_s: int) -> None:
        self.app = app
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.places = Places(max_concurrent) if max_concurrent else None
        self.num_waiting = 0  # requests in, not yet holding their places

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Requests already in but not yet at `admit` count against the free places (one each): a burst
        # that arrives before any of them has planned would otherwise all be let in.
        if self.places is not None and self.num_waiting - self.places.available >= self.max_queued:
            await refuse(scope, receive, send, 429, "the server is at its request limit; retry later",
                         "overloaded", {"Retry-After": str(self.retry_after_s)})
            return
        ticket = Ticket(self)
        token = _current_ticket.set(ticket)
        try:
            await self.app(scope, receive, send)
        finally:
            _current_ticket.reset(token)
            ticket.release()
