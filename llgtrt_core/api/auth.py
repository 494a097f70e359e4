"""Optional API key: when configured, every protected route needs `Authorization: Bearer <key>` (api/gate.py),
or `x-api-key: <key>` as the `anthropic` client sends it.

A pure ASGI middleware (not BaseHTTPMiddleware) so streamed responses and disconnects pass through
untouched. A wrong or missing key gets OpenAI's 401 body (code `invalid_api_key`).
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from llgtrt_core import metrics
from llgtrt_core.api.errors import error_body
from llgtrt_core.api.protocol import ErrorInfo


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        metrics.requests_rejected.labels(reason="unauthorized").inc()
        info = ErrorInfo(message="Incorrect or missing API key: send `Authorization: Bearer <key>`",
                         type="invalid_request_error", code="invalid_api_key")
        response = JSONResponse(error_body(info), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        bearer = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        key = next((value for name, value in scope["headers"] if name == b"x-api-key"), b"")
        # Constant time, both compared: no key guessing by timing.
        return hmac.compare_digest(bearer, self.expected) | hmac.compare_digest(key, self.key)

