"""CORS for the API routes (/v1/* and the generating routes), off unless origins are configured.

Installed on the whole service outside the request gate: a browser's preflight carries no API key,
so it must be answered before the key is checked. BentoML's own routes are left alone.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from llgtrt_core.api.app import is_protected


class ApiCors:
    def __init__(self, app: ASGIApp, allow_origins: list[str]) -> None:
        self.app = app
        self.cors = CORSMiddleware(app, allow_origins=allow_origins, allow_methods=["*"], allow_headers=["*"],
                                   allow_credentials="*" not in allow_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected(scope.get("path", "")):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
