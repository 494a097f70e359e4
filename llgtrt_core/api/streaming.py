"""Server-sent events, and freeing engine work when the client goes away.

A streamed response ends its body iterator in every case (finished, client gone, cancelled), so
the engine requests beneath it are aborted at once rather than when the garbage collector gets
to them. A non-streamed request is raced against the client's disconnect for the same reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, Callable, Optional, TypeVar

import pydantic_core
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from llgtrt_core.api.errors import APIError, error_body
from llgtrt_core.api.generation import close_quietly
from llgtrt_core.api.protocol import ErrorInfo
from llgtrt_core.api.shutdown import SHUTDOWN

T = TypeVar("T")
logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"
SHUTDOWN_CUT = ErrorInfo(message="the server is shutting down: the response was cut at its graceful-shutdown timeout",
                         type="server_error", code="shutting_down")


def sse_event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


TEXT_PLACEHOLDER = "\x00text\x00"  # the text of the chunk a TextEvents is made from


class TextEvents:
    """The SSE events of chunks that differ only in one text field (a choice's plain text deltas).

    Building and dumping a pydantic chunk model takes ~15 us per delta, on the GIL the engine thread
    needs too. So the chunk model is dumped once, with TEXT_PLACEHOLDER as its text, and each delta
    only JSON-escapes its text into that frame (~1 us): the model stays the one definition of the
    shape, and pydantic's own string encoder keeps the bytes those of `sse_event` for the same chunk.
    """

    def __init__(self, chunk: BaseModel) -> None:
        # The last occurrence: every field after the text is null here, while the model name before
        # it could hold anything.
        self._head, placeholder, self._tail = sse_event(chunk).rpartition(_json_string(TEXT_PLACEHOLDER))
        if not placeholder:
            raise ValueError("the chunk's text is not TEXT_PLACEHOLDER")

    def __call__(self, text: str) -> str:
        return self._head + _json_string(text) + self._tail


def _json_string(text: str) -> str:
    return pydantic_core.to_json(text).decode()


def sse_error_event(info: ErrorInfo) -> str:
    """A failure after the 200 went out; the openai client raises APIError on it."""
    return f"data: {json.dumps(error_body(info))}\n\n"


async def sse_stream(events: AsyncIterator[str], error_event: Callable[[ErrorInfo], str] = sse_error_event,
                     done_event: Optional[str] = DONE_EVENT) -> AsyncIterator[str]:
    """Ends a stream of events with `done_event`, or with `error_event` if producing them failed; one
    cut by graceful shutdown with `error_event`, then `done_event`."""
    try:
        async for event in events:
            yield event
            if SHUTDOWN.cut:
                yield error_event(SHUTDOWN_CUT)
                break
        if done_event is not None:
            yield done_event
    except APIError as e:
        yield error_event(e.info)
    except Exception as e:  # a bug: still end the stream the way the client understands
        logger.exception("streaming failed")
        yield error_event(ErrorInfo(message=f"internal error: {e!r}", type="server_error"))
    finally:
        await close_quietly(events)


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], error_event: Callable[[ErrorInfo], str] = sse_error_event,
                 done_event: Optional[str] = DONE_EVENT):
        super().__init__(sse_stream(events, error_event, done_event),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await close_quietly(self.body_iterator)


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (its cleanup aborts engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()
