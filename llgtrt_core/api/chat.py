"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llgtrt_core.api.generation import ChoiceUpdate, close_quietly, collect
from llgtrt_core.api.prompts import chat_prompt_ids
from llgtrt_core.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    now,
    random_id,
)
from llgtrt_core.api.sampling import check_request, start_choices
from llgtrt_core.api.streaming import ClientDisconnected, EventStreamResponse, cancel_on_disconnect, sse_event
from llgtrt_core.runtime import ModelRuntime


async def create_chat_completion(request: ChatCompletionRequest, runtime: ModelRuntime, raw_request: Request) -> Response:
    check_request(request, runtime)
    prompt_ids = chat_prompt_ids(request, runtime.tokenizer)
    response_id = random_id("chatcmpl")
    planned, updates = await start_choices(request, runtime, [prompt_ids], response_id)
    if request.stream:
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        return EventStreamResponse(
            _stream(updates, response_id, runtime.model_name, request.n, len(prompt_ids), include_usage))
    try:
        results = await cancel_on_disconnect(raw_request, collect(updates, len(planned)))
    except ClientDisconnected:
        return Response(status_code=499)
    completion_tokens = sum(r.num_generated_tokens for r in results)
    response = ChatCompletionResponse(
        id=response_id,
        model=runtime.model_name,
        choices=[
            ChatCompletionResponseChoice(index=i, message=ChatMessage(content=r.text), finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ],
        usage=UsageInfo.of(len(prompt_ids), completion_tokens),
    )
    return JSONResponse(response.model_dump())


async def _stream(updates: AsyncIterator[ChoiceUpdate], response_id: str, model: str, num_choices: int,
                  prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: Optional[UsageInfo] = None) -> str:
        return sse_event(ChatCompletionStreamResponse(id=response_id, created=created, model=model,
                                                      choices=choices, usage=usage))

    completion_tokens = [0] * num_choices
    try:
        for index in range(num_choices):
            yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for update in updates:
            completion_tokens[update.index] = update.num_generated_tokens
            delta = DeltaMessage(content=update.text or None)
            yield chunk([ChatCompletionResponseStreamChoice(index=update.index, delta=delta,
                                                            finish_reason=update.finish_reason)])
        if include_usage:
            yield chunk([], UsageInfo.of(prompt_tokens, sum(completion_tokens)))
    finally:
        await close_quietly(updates)
