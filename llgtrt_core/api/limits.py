"""Request limits of the OpenAI app: body size (413) and admission of generation requests (429).

Generation requests (POST .../completions: chat and legacy) hold one of `max_concurrent` places from the moment they are
admitted until their response (streamed or not) ends; up to `max_queued` more wait for a place;
past that a request is refused at once with 429 and Retry-After, before any work is done for it.
Both are pure ASGI middlewares, so streaming and disconnect detection pass through untouched.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llgtrt_core import metrics
from llgtrt_core.api.errors import error_body, error_type
from llgtrt_core.api.protocol import ErrorInfo
from llgtrt_core.config import ServerConfig


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, reason: str,
                  headers: dict[str, str] | None = None) -> None:
    metrics.requests_rejected.labels(reason=reason).inc()
    body = error_body(ErrorInfo(message=message, type=error_type(status), code=reason))
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


class BodySizeLimit:
    """Reads the body up front (requests are JSON the app reads whole anyway), refusing it past
    `max_bytes`, whatever Content-Length claims; then replays it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
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
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # afterwards: the disconnect the app may wait for

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _refuse(scope, receive, send, 413, f"request body larger than {self.max_bytes} bytes", "too_large")


class AdmissionLimit:
    def __init__(self, app: ASGIApp, max_concurrent: int, max_queued: int, retry_after_s: int) -> None:
        self.app = app
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.places = asyncio.Semaphore(max_concurrent)
        self.num_queued = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("/completions"):
            await self.app(scope, receive, send)  # /tokenize and /detokenize never wait behind generation
            return
        if self.places.locked() and self.num_queued >= self.max_queued:
            await _refuse(scope, receive, send, 429, "the server is at its request limit; retry later",
                          "overloaded", {"Retry-After": str(self.retry_after_s)})
            return
        self.num_queued += 1
        try:
            await self.places.acquire()
        finally:
            self.num_queued -= 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.places.release()


def install_limits(app: FastAPI, server: ServerConfig) -> None:
    """Add the limits `server` sets (0 turns one off); the size check runs first."""
    if server.max_concurrent_requests:
        app.add_middleware(AdmissionLimit, max_concurrent=server.max_concurrent_requests,
                           max_queued=server.max_queued_requests, retry_after_s=server.retry_after_seconds)
    if server.max_request_bytes:
        app.add_middleware(BodySizeLimit, max_bytes=server.max_request_bytes)
