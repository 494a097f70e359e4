"""GET /health and GET /version at the server's root, as vLLM serves them (scripts moving over poll
them); BentoML's own /livez and /readyz stay."""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from llgtrt_core import __version__
from llgtrt_core.runtime import ModelRuntime


def create_root_app(get_runtime: Callable[[], Optional[ModelRuntime]]) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> Response:
        """200 once the model is loaded (vLLM: the engine is alive), 503 before."""
        try:
            ready = get_runtime() is not None
        except Exception:
            ready = False
        return Response(status_code=200 if ready else 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return app
