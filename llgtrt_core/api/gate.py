"""The one gate in front of every protected route, installed once on the whole service.

Which routes it covers is declared in api/app.py: every path under /v1 and bentoml's `generate`
are protected (503 while draining, the API key, the body limit and its text check); those in
GENERATION_PATHS also go through admission (429) and are what graceful shutdown drains. Health,
readiness, metrics and BentoML's own pages stay open.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from llgtrt_core.api.app import is_protected, GENERATION_PATHS
from llgtrt_core.api.auth import BearerAuth
from llgtrt_core.api.limits import AdmissionLimit, RequestBody, refuse
from llgtrt_core.api.shutdown import SHUTDOWN, Shutdown
from llgtrt_core.config import ServerConfig


class RequestGate:
    def __init__(self, app: ASGIApp, server: ServerConfig, shutdown: Shutdown = SHUTDOWN) -> None:
        self.app = app
        self.shutdown = shutdown
        # Admission first: an overloaded server refuses before reading the body.
        self.generating: ASGIApp = AdmissionLimit(RequestBody(app, server.max_request_bytes),
                                                  server.max_concurrent_requests, server.max_queued_requests,
                                                  server.retry_after_seconds)
        self.other: ASGIApp = RequestBody(app, server.max_request_bytes)
        if server.api_key:  # outermost: nothing is read before the key is checked
            self.generating = BearerAuth(self.generating, server.api_key)
            self.other = BearerAuth(self.other, server.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not is_protected(path):
            await self.app(scope, receive, send)
            return
        if self.shutdown.draining:
            await refuse(scope, receive, send, 503, "the server is shutting down; retry on another replica",
                         "shutting_down", {"Connection": "close"})
            return
        if path not in GENERATION_PATHS:
            await self.other(scope, receive, send)
            return
        with self.shutdown.tracking():
            await self.generating(scope, receive, send)
