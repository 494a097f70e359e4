"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llgtrt_core.api.generation import ChoiceUpdate, close_quietly, collect
from llgtrt_core.api.prompts import completion_prompt_ids
from llgtrt_core.api.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    now,
    random_id,
)
from llgtrt_core.api.sampling import check_request, start_choices
from llgtrt_core.api.streaming import ClientDisconnected, EventStreamResponse, cancel_on_disconnect, sse_event
from llgtrt_core.engine.interface import GenerationRequest
from llgtrt_core.runtime import ModelRuntime


async def _start(request: CompletionRequest, runtime: ModelRuntime, response_id: str
                 ) -> tuple[list[list[int]], list[GenerationRequest], AsyncIterator[ChoiceUpdate]]:
    check_request(request, runtime)
    prompts = completion_prompt_ids(request, runtime.tokenizer, runtime.tokenizer.vocab_size)
    planned, updates = await start_choices(request, runtime, prompts, response_id)
    return prompts, planned, updates


async def completion_text(request: CompletionRequest, runtime: ModelRuntime) -> AsyncIterator[str]:
    """The generated text as it comes, choices interleaved (bentoml's own `generate` API).

    Bad requests raise APIError before the first piece.
    """
    _, _, updates = await _start(request, runtime, random_id("cmpl"))
    try:
        async for update in updates:
            if update.text:
                yield update.text
    finally:
        await close_quietly(updates)


async def create_completion(request: CompletionRequest, runtime: ModelRuntime, raw_request: Request) -> Response:
    response_id = random_id("cmpl")
    prompts, planned, updates = await _start(request, runtime, response_id)
    # echo: choice i repeats its prompt (prompt p serves choices p*n .. p*n+n-1).
    echoes = [runtime.tokenizer.decode(r.prompt_token_ids) if request.echo else "" for r in planned]
    prompt_tokens = sum(len(p) for p in prompts)
    if request.stream:
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        return EventStreamResponse(_stream(updates, response_id, runtime.model_name, echoes, prompt_tokens, include_usage))
    try:
        results = await cancel_on_disconnect(raw_request, collect(updates, len(planned)))
    except ClientDisconnected:
        return Response(status_code=499)
    completion_tokens = sum(r.num_generated_tokens for r in results)
    response = CompletionResponse(
        id=response_id,
        model=runtime.model_name,
        choices=[
            CompletionResponseChoice(index=i, text=echoes[i] + r.text, finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ],
        usage=UsageInfo.of(prompt_tokens, completion_tokens),
    )
    return JSONResponse(response.model_dump())


async def _stream(updates: AsyncIterator[ChoiceUpdate], response_id: str, model: str, echoes: list[str],
                  prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[CompletionResponseChoice], usage: Optional[UsageInfo] = None) -> str:
        return sse_event(CompletionStreamResponse(id=response_id, created=created, model=model,
                                                  choices=choices, usage=usage))

    completion_tokens = [0] * len(echoes)
    try:
        for index, echo in enumerate(echoes):
            if echo:
                yield chunk([CompletionResponseChoice(index=index, text=echo)])
        async for update in updates:
            completion_tokens[update.index] = update.num_generated_tokens
            yield chunk([CompletionResponseChoice(index=update.index, text=update.text,
                                                  finish_reason=update.finish_reason)])
        if include_usage:
            yield chunk([], UsageInfo.of(prompt_tokens, sum(completion_tokens)))
    finally:
        await close_quietly(updates)
