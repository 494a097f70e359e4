"""The one generation skeleton of every generating endpoint (chat, completions, responses).

An endpoint validates its request and builds its prompts, then hands over here: the engine requests
start, and nothing is sent before the engine accepted every choice (its first delta, per the engine
contract), so whatever the engine refuses is a 400, never an error event after a 200. Then the
endpoint's `Writer` turns the choices' updates into its own shapes: a streamed body of events or
one JSON body. Usage, disconnects (499, engine requests aborted) and errors are handled here once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llgtrt_core.api.errors import APIError
from llgtrt_core.api.generation import ChoiceResult, ChoiceUpdate, close_quietly, collect
from llgtrt_core.api.protocol import ErrorInfo
from llgtrt_core.api.sampling import ApiRequest, start_choices
from llgtrt_core.api.streaming import (DONE_EVENT, ClientDisconnected, EventStreamResponse, cancel_on_disconnect,
                                       sse_error_event)
from llgtrt_core.constraints.request_grammar import RequestGrammar
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tools import ToolFormat


@dataclass
class Generation:
    """Engine requests the engine accepted, and their updates (acceptance-only ones left out)."""

    response_id: str
    prompts: list[list[int]]
    num_choices: int
    updates: AsyncIterator[ChoiceUpdate] = field(init=False)
    # Per choice, its prompt tokens the engine took from its prefix cache, once the engine said.
    choice_cached_tokens: list[Optional[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.choice_cached_tokens = [None] * self.num_choices

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def cached_tokens(self) -> Optional[int]:
        """Of `prompt_tokens`, those served from the engine's prefix cache, counted like them: once per
        prompt, as its first choice saw it; None when the engine does not say."""
        firsts = self.choice_cached_tokens[::self.num_choices // len(self.prompts)]
        return None if None in firsts else sum(firsts)  # type: ignore[arg-type]


class GenerationStopped(APIError):
    """The generation was stopped on purpose (a cancelled response), not by a failure."""

    CODE = "cancelled"

    def __init__(self) -> None:
        super().__init__("the response was cancelled", code=self.CODE)


def completion_tokens(results: list[ChoiceResult]) -> int:
    return sum(r.num_generated_tokens for r in results)  # every choice (and best_of candidate) counts


class Writer(Protocol):
    """An endpoint's output: what the skeleton cannot know about its shapes."""

    done_event: Optional[str]  # the stream's last event when it ends well (chat's `data: [DONE]`)

    def events(self, generation: Generation) -> AsyncIterator[str]:
        """The streamed body's server-sent events."""
        ...

    def error_event(self, info: ErrorInfo) -> str:
        """The event ending a stream that failed after its 200 went out."""
        ...

    def body(self, generation: Generation, results: list[ChoiceResult]) -> Any:
        """The non-streamed response (JSON-able)."""
        ...


class DoneTerminatedWriter:
    """The chat and completions streams' ending: `data: [DONE]`, a failure as an OpenAI error event."""

    done_event: Optional[str] = DONE_EVENT
    error_event = staticmethod(sse_error_event)


async def start_generation(request: ApiRequest, runtime: ModelRuntime, prompts: list[list[int]], response_id: str,
                           grammar: Optional[RequestGrammar] = None, stop: Optional[asyncio.Event] = None,
                           repeated_calls_stop: Optional[ToolFormat] = None) -> Generation:
    """Start every choice and wait until the engine accepted each one (or raise its refusal).

    Once `stop` is set, the updates end with GenerationStopped (their engine requests aborted)."""
    planned, updates = await start_choices(request, runtime, prompts, response_id, grammar, repeated_calls_stop)
    held: list[ChoiceUpdate] = []
    waiting = set(range(len(planned)))
    try:
        while waiting:
            update = await anext(updates)
            waiting.discard(update.index)
            if not update.is_acceptance:
                held.append(update)
    except BaseException:
        await close_quietly(updates)
        raise
    generation = Generation(response_id, prompts, len(planned))
    generation.updates = _replayed(generation, held, updates, stop)
    return generation


async def _replayed(generation: Generation, held: list[ChoiceUpdate], updates: AsyncIterator[ChoiceUpdate],
                    stop: Optional[asyncio.Event]) -> AsyncIterator[ChoiceUpdate]:
    """The held updates, then the rest; each choice's cached tokens noted on the way."""
    try:
        for update in held:
            _note(generation, update)
            yield update
        async for update in updates:
            if stop is not None and stop.is_set():
                raise GenerationStopped()
            if not update.is_acceptance:
                _note(generation, update)
                yield update
    finally:
        await close_quietly(updates)


def _note(generation: Generation, update: ChoiceUpdate) -> None:
    if update.cached_tokens is not None:
        generation.choice_cached_tokens[update.index] = update.cached_tokens


async def serve(raw_request: Request, runtime: ModelRuntime, request: ApiRequest, prompts: list[list[int]],
                response_id: str, writer: Writer, *, stream: bool, grammar: Optional[RequestGrammar] = None,
                stop: Optional[asyncio.Event] = None, repeated_calls_stop: Optional[ToolFormat] = None) -> Response:
    """Run the request to the end: the streamed events, or the whole body once every choice finished."""
    try:
        generation = await cancel_on_disconnect(
            raw_request, start_generation(request, runtime, prompts, response_id, grammar, stop, repeated_calls_stop))
    except ClientDisconnected:
        return Response(status_code=499)
    if stream:
        return EventStreamResponse(writer.events(generation), writer.error_event, writer.done_event)
    try:
        results = await cancel_on_disconnect(raw_request, collect(generation.updates, generation.num_choices))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await close_quietly(generation.updates)
    return JSONResponse(writer.body(generation, results))
