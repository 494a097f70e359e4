"""BentoML's HTTP traffic metrics, labelled by route instead of by raw path.

BentoML 1.4.39's RunnerTrafficMetricsMiddleware (bentoml/_internal/server/http/instruments.py, the
one its service app installs) labels every series with `scope["path"]`: each distinct path a client
makes up adds ~20 series to /metrics, for as long as the worker lives, so unauthenticated scanning
grows every scrape without bound. This subclass, put in its place before the app is built, gives
every path no route serves one label; the app beneath still sees the real path.
"""

from __future__ import annotations

from typing import Iterable

from bentoml._internal.server.http import instruments
from starlette.types import ASGIApp, Receive, Scope, Send

UNKNOWN_ROUTE = "/{unknown}"
_REAL_PATH = "llgtrt.real_path"


class _RestorePath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _REAL_PATH in scope:
            scope = {**scope, "path": scope[_REAL_PATH]}
        await self.app(scope, receive, send)


class RouteLabelledTrafficMetrics(instruments.RunnerTrafficMetricsMiddleware):
    known_paths: frozenset[str] = frozenset()
    known_prefixes: tuple[str, ...] = ()  # static files: labelled by the prefix

    def __init__(self, app: ASGIApp, **options: object) -> None:
        super().__init__(_RestorePath(app), **options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and path not in self.known_paths:
            label = next((prefix for prefix in self.known_prefixes if path.startswith(prefix)), UNKNOWN_ROUTE)
            scope = {**scope, "path": label, _REAL_PATH: path}
        await super().__call__(scope, receive, send)


def label_traffic_metrics_by_route(known_paths: Iterable[str], known_prefixes: Iterable[str]) -> None:
    """Call before BentoML builds the service app (at the service module's import)."""
    RouteLabelledTrafficMetrics.known_paths = frozenset(known_paths)
    RouteLabelledTrafficMetrics.known_prefixes = tuple(known_prefixes)
    instruments.RunnerTrafficMetricsMiddleware = RouteLabelledTrafficMetrics  # type: ignore[misc]
