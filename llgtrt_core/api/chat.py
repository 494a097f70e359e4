"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llgtrt_core.api.generation import ChoiceUpdate, close_quietly, collect
from llgtrt_core.api.logprobs import chat_logprobs
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
from llgtrt_core.api.streaming import (
    TEXT_PLACEHOLDER,
    ClientDisconnected,
    EventStreamResponse,
    TextEvents,
    cancel_on_disconnect,
    sse_event,
)
from llgtrt_core.api.tool_calls import ChoiceToolOutput, keeps_special_tokens, request_tool_plan, tool_constraint
from llgtrt_core.runtime import ModelRuntime


async def create_chat_completion(request: ChatCompletionRequest, runtime: ModelRuntime, raw_request: Request) -> Response:
    check_request(request, runtime)
    plan = request_tool_plan(request, runtime)
    prompt_ids = await chat_prompt_ids(request, runtime, plan)
    grammar = await tool_constraint(plan, request, runtime)
    if keeps_special_tokens(plan, runtime.tokenizer):
        request = request.model_copy(update={"skip_special_tokens": False})
    response_id = random_id("chatcmpl")
    parses_calls = plan is not None and plan.parses_calls
    repeats_stop = plan.format if parses_calls and request.stop_repeated_tool_calls else None
    planned, updates = await start_choices(request, runtime, [prompt_ids], response_id, grammar, repeats_stop)
    outputs = [ChoiceToolOutput(plan) if parses_calls else None for _ in range(request.n)]
    if request.stream:
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        return EventStreamResponse(
            _stream(updates, response_id, runtime, outputs, len(prompt_ids), include_usage))
    try:
        results = await cancel_on_disconnect(raw_request, collect(updates, len(planned)))
    except ClientDisconnected:
        return Response(status_code=499)
    completion_tokens = sum(r.num_generated_tokens for r in results)
    response = ChatCompletionResponse(
        id=response_id,
        model=runtime.model_name,
        choices=[
            ChatCompletionResponseChoice(index=i, message=_message(outputs[i], r.text),
                                         finish_reason=_finish_reason(outputs[i], r.finish_reason),
                                         logprobs=chat_logprobs(runtime, r.token_ids, r.logprobs))
            for i, r in enumerate(results)
        ],
        usage=UsageInfo.of(len(prompt_ids), completion_tokens),
    )
    return JSONResponse(response.model_dump())


def _message(tools: Optional[ChoiceToolOutput], text: str) -> ChatMessage:
    return ChatMessage(content=text) if tools is None else tools.message(text)


def _delta(tools: Optional[ChoiceToolOutput], update: ChoiceUpdate) -> DeltaMessage:
    if tools is None:
        return DeltaMessage(content=update.text or None)
    return tools.delta(update.text, finished=update.finish_reason is not None)


def _finish_reason(tools: Optional[ChoiceToolOutput], finish_reason: Optional[str]) -> Optional[str]:
    return finish_reason if tools is None else tools.finish_reason(finish_reason)


async def _stream(updates: AsyncIterator[ChoiceUpdate], response_id: str, runtime: ModelRuntime,
                  tools: list[Optional[ChoiceToolOutput]], prompt_tokens: int, include_usage: bool
                  ) -> AsyncIterator[str]:
    """`tools[i]` parses choice i's calls (None: plain text)."""
    created = now()
    num_choices = len(tools)
    model = runtime.model_name

    def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: Optional[UsageInfo] = None
              ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=response_id, created=created, model=model, choices=choices, usage=usage)

    # Most chunks are plain text (no tool calls, logprobs or finish reason): each choice's from a template.
    text_events = [TextEvents(chunk([ChatCompletionResponseStreamChoice(
        index=index, delta=DeltaMessage(content=TEXT_PLACEHOLDER))])) for index in range(num_choices)]
    completion_tokens = [0] * num_choices
    try:
        for index in range(num_choices):
            yield sse_event(chunk([ChatCompletionResponseStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content=""))]))
        async for update in updates:
            completion_tokens[update.index] = update.num_generated_tokens
            if (tools[update.index] is None and update.text and update.logprobs is None
                    and update.finish_reason is None):
                yield text_events[update.index](update.text)
                continue
            delta = _delta(tools[update.index], update)
            logprobs = chat_logprobs(runtime, update.token_ids, update.logprobs)
            finish_reason = _finish_reason(tools[update.index], update.finish_reason)
            if delta.is_empty() and logprobs is None and finish_reason is None:
                continue  # tool-call markup only: nothing to tell the client yet
            yield sse_event(chunk([ChatCompletionResponseStreamChoice(
                index=update.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)]))
        if include_usage:
            yield sse_event(chunk([], UsageInfo.of(prompt_tokens, sum(completion_tokens))))
    finally:
        await close_quietly(updates)
