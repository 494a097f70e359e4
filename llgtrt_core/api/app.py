"""The OpenAI-compatible FastAPI app; the service mounts it at /v1."""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.routing import Match, Route, Router
from starlette.types import Scope

from llgtrt_core.api.chat import create_chat_completion
from llgtrt_core.api.completions import create_completion
from llgtrt_core.api.errors import APIError, install_error_handlers
from llgtrt_core.api.messages import count_tokens, create_message
from llgtrt_core.api.messages_protocol import MessageObject, TokenCount
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
from llgtrt_core.api.response_store import MemoryResponseStore, ResponseStore
from llgtrt_core.api.response_store_shared import SharedResponseStore
from llgtrt_core.api.responses import ResponsesAPI
from llgtrt_core.api.responses_protocol import ResponseDeleted, ResponseObject, ResponsesRequest
from llgtrt_core.api.tokenize import tokenize, detokenize
from llgtrt_core.config import ServerConfig
from llgtrt_core.runtime import ModelRuntime

_ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 404, 500, 503)}

API_PREFIX = "/v1"  # where the service mounts this app
# Every route that generates text, by full path. Declared once, here: the request gate (api/gate.py)
# admits them (429, one place per sequence) and drains them on shutdown, and tracing skips them
# (service.py). A new generating route is one more entry; one left out fails on its first request.
GENERATION_PATHS = frozenset({f"{API_PREFIX}/chat/completions", f"{API_PREFIX}/completions", f"{API_PREFIX}/responses",
                              f"{API_PREFIX}/messages", "/generate"})


def is_protected(path: str) -> bool:
    """Routes behind the API key and body limit: the whole OpenAI app, and every generating route."""
    return path == API_PREFIX or path.startswith(f"{API_PREFIX}/") or path in GENERATION_PATHS


def create_app(get_runtime: Callable[[], Optional[ModelRuntime]], config: ServerConfig = ServerConfig()) -> FastAPI:
    """`get_runtime` returns the loaded model, or None / raises while it is still loading."""
    app = FastAPI(title="llgtrt OpenAI-compatible API", responses=_ERROR_RESPONSES)
    install_error_handlers(app)
    responses_api = ResponsesAPI(_response_store(config))

    async def runtime() -> ModelRuntime:  # async: FastAPI runs a plain function on a thread pool, a hop per request
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

    @app.post("/responses", response_model=ResponseObject)
    async def create_response(request: ResponsesRequest, raw_request: Request,
                              loaded: ModelRuntime = Depends(runtime)) -> Response:
        return await responses_api.create(request, loaded, raw_request)

    # Anthropic's Messages API: the body is parsed in the handler, so that every error has Anthropic's shape.
    @app.post("/messages", response_model=MessageObject)
    async def messages(raw_request: Request) -> Response:
        return await create_message(raw_request, runtime)

    @app.post("/messages/count_tokens", response_model=TokenCount)
    async def messages_count_tokens(raw_request: Request) -> Response:
        return await count_tokens(raw_request, runtime)

    @app.get("/responses/{response_id}", response_model=ResponseObject)
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses_api.retrieve(response_id)

    @app.delete("/responses/{response_id}", response_model=ResponseDeleted)
    async def delete_response(response_id: str) -> dict[str, Any]:
        return responses_api.delete(response_id)

    @app.post("/responses/{response_id}/cancel", response_model=ResponseObject)
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return responses_api.cancel(response_id)

    @app.get("/models", response_model=ModelList)
    async def models(loaded: ModelRuntime = Depends(runtime)) -> ModelList:
        return ModelList(data=[_model_card(loaded)])

    @app.get("/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str, loaded: ModelRuntime = Depends(runtime)) -> ModelCard:
        if model_id != loaded.model_name:
            raise APIError(f"The model `{model_id}` does not exist.", status_code=404, param="model",
                           code="model_not_found")
        return _model_card(loaded)

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

    app.router.routes.append(_UnknownPath(app.router))
    return app


def _response_store(config: ServerConfig) -> ResponseStore:
    """Several API workers share one store: a client's next request may reach any of them."""
    size, ttl = config.response_store_size, config.response_store_ttl_seconds
    return SharedResponseStore(size, ttl) if config.several_api_workers else MemoryResponseStore(size, ttl)


def _model_card(loaded: ModelRuntime) -> ModelCard:
    return ModelCard(id=loaded.model_name, max_model_len=loaded.engine.max_model_len)


class _UnknownPath(Route):
    """Every path no other route of the app has, whatever the order routes were added in: OpenAI's
    JSON 404. BentoML mounts the app passively (it hands a request over only when some route of the
    app matches, and answers plain text itself otherwise), so without this route unknown paths under
    the mount never reach the app. A path another route has with another method is left to that
    route (Starlette's 405 with Allow, in the JSON error shape)."""

    def __init__(self, router: Router) -> None:
        super().__init__("/{path:path}", self._answer, include_in_schema=False,
                         methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
        self.router = router

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if any(route.matches(scope)[0] != Match.NONE for route in self.router.routes if route is not self):
            return Match.NONE, {}
        return super().matches(scope)

    async def _answer(self, request: Request) -> Response:
        raise APIError(f"Unknown request URL: {request.method} {request.url.path}. Please check the URL for typos.",
                       status_code=404, code="unknown_url")
