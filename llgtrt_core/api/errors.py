"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure the app can produce goes through here: our own `APIError`s, request validation
(400 like OpenAI and vLLM, not FastAPI's 422, with `param` naming the field), unknown routes and
unexpected exceptions (500, logged, the connection kept; bad input must never get here).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llgtrt_core.api.protocol import ErrorInfo, ErrorResponse, ParamError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}
_MAX_REPORTED_VALIDATION_ERRORS = 3


class APIError(Exception):
    def __init__(self, message: str, *, status_code: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers
        self.info = ErrorInfo(message=message, type=type or error_type(status_code), param=param, code=code)


def error_type(status_code: int) -> str:
    return _TYPE_BY_STATUS.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")


def error_body(info: ErrorInfo) -> dict[str, Any]:
    return ErrorResponse(error=info).model_dump()


def _json_response(status_code: int, info: ErrorInfo, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(status_code=status_code, content=error_body(info), headers=headers)


def _param_from_loc(loc: Sequence[Any]) -> Optional[str]:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'.

    Pydantic adds the union member it tried to the location ('str', 'list[int]', a model's
    class name); API field names are lower case, so drop those.
    """
    parts: list[str] = []
    for i, item in enumerate(loc):
        if i == 0 and item == "body":
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" in item or item[:1].isupper() or item in ("str", "int", "float", "bool", "dict", "list", "none"):
            continue
        else:
            parts.append(f".{item}" if parts else item)
    return "".join(parts) or None


def _describe(error: dict[str, Any]) -> tuple[Optional[str], str]:
    """(param, message) for one pydantic error."""
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return cause.param, cause.message
    param = _param_from_loc(error.get("loc", ()))
    kind = error.get("type")
    if kind == "extra_forbidden":
        return param, f"Unrecognized request argument supplied: {param}"
    if kind == "json_invalid":
        return None, f"Request body is not valid JSON: {(error.get('ctx') or {}).get('error', '')}".rstrip(": ")
    if kind == "missing" and param is None:
        return None, "Request body is missing"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return param, f"{param}: {message}" if param else message


def validation_error(errors: Sequence[dict[str, Any]]) -> ErrorInfo:
    described = [_describe(e) for e in errors]
    messages = list(dict.fromkeys(message for _, message in described))  # unique, in order
    text = "; ".join(messages[:_MAX_REPORTED_VALIDATION_ERRORS])
    if len(messages) > _MAX_REPORTED_VALIDATION_ERRORS:
        text += f" (and {len(messages) - _MAX_REPORTED_VALIDATION_ERRORS} more)"
    param = described[0][0] if described else None
    return ErrorInfo(message=text or "invalid request", type="invalid_request_error", param=param, code=None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _json_response(exc.status_code, exc.info, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _json_response(400, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        info = ErrorInfo(message=str(exc.detail), type=error_type(exc.status_code))
        return _json_response(exc.status_code, info, exc.headers)  # a 405's Allow among them

    app.add_middleware(UnexpectedErrors)


class UnexpectedErrors:
    """A 500 for an unexpected exception, which ends here. Starlette's own handler re-raises it after
    answering, and uvicorn then drops the connection: the client's next request on it fails too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started or scope["type"] != "http":
                raise  # a response is half sent: only dropping the connection tells the client
            logger.exception("unhandled error")
            info = ErrorInfo(message=f"internal error: {exc!r}", type="server_error")
            await _json_response(500, info)(scope, receive, send)
