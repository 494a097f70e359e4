"""The OpenAI-compatible FastAPI app; the service mounts it at /v1."""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from llgtrt_core.api.chat import create_chat_completion
from llgtrt_core.api.completions import create_completion
from llgtrt_core.api.errors import APIError, install_error_handlers
from llgtrt_core.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EngineStats,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from llgtrt_core.api.tokenize import tokenize, detokenize
from llgtrt_core.runtime import ModelRuntime

_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 404, 500, 503)}

API_PREFIX = "/v1"  # where the service mounts this app
# Every route that generates text, by full path. Declared once, here: the request gate (api/gate.py)
# admits them (429, one place per sequence) and drains them on shutdown, and tracing skips them
# (service.py). A new generating route is one more entry; one left out fails on its first request.
GENERATION_PATHS = frozenset({f"{API_PREFIX}/chat/completions", f"{API_PREFIX}/completions", "/generate"})


def is_protected(path: str) -> bool:
    """Routes behind the API key and body limit: the whole OpenAI app, and every generating route."""
    return path == API_PREFIX or path.startswith(f"{API_PREFIX}/") or path in GENERATION_PATHS


def create_app(get_runtime: Callable[[], Optional[ModelRuntime]]) -> FastAPI:
    """`get_runtime` returns the loaded model, or None / raises while it is still loading."""
    app = FastAPI(title="llgtrt OpenAI-compatible API", responses=_ERROR_RESPONSES)
    install_error_handlers(app)

    def runtime() -> ModelRuntime:
        try:
            loaded = get_runtime()
        except Exception as e:
            raise APIError(f"the model is not ready: {e}", status_code=503) from e
        if loaded is None:
            raise APIError("the model is still loading", status_code=503)
        return loaded

    @app.post("/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request,
                               loaded: ModelRuntime = Depends(runtime)) -> Response:
        return await create_chat_completion(request, loaded, raw_request)

    @app.post("/completions", response_model=CompletionResponse)
    async def completions(request: CompletionRequest, raw_request: Request,
                          loaded: ModelRuntime = Depends(runtime)) -> Response:
        return await create_completion(request, loaded, raw_request)

    @app.get("/models", response_model=ModelList)
    async def models(loaded: ModelRuntime = Depends(runtime)) -> ModelList:
        return ModelList(data=[ModelCard(id=loaded.model_name, max_model_len=loaded.engine.max_model_len)])

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(request: TokenizeRequest, loaded: ModelRuntime = Depends(runtime)) -> TokenizeResponse:
        return await tokenize(request, loaded)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(request: DetokenizeRequest,
                               loaded: ModelRuntime = Depends(runtime)) -> DetokenizeResponse:
        return await detokenize(request, loaded)

    @app.get("/engine/stats", response_model=EngineStats)
    async def engine_stats(loaded: ModelRuntime = Depends(runtime)) -> EngineStats:
        return EngineStats(num_active=loaded.engine.num_active, **await loaded.engine.stats())

    return app
