"""POST /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from llgtrt_core.api.generation import ChoiceResult, ChoiceUpdate, close_quietly
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
from llgtrt_core.api.reasoning import request_section, with_template_switch, with_thinking
from llgtrt_core.api.sampling import build_request_grammar, check_request
from llgtrt_core.api.serving import DoneTerminatedWriter, Generation, completion_tokens, serve
from llgtrt_core.api.streaming import TEXT_PLACEHOLDER, TextEvents, sse_event
from llgtrt_core.api.tool_calls import ChoiceToolOutput, keeps_special_tokens, request_tool_plan, tool_constraint
from llgtrt_core.constraints.request_grammar import RequestGrammar
from llgtrt_core.reasoning import ReasoningSection, ReasoningSplitter
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tools import ToolFormat, ToolPlan


@dataclass(frozen=True)
class ChatPlan:
    """A chat request ready to start: its prompt, tools, thinking section and the grammar that replaces its own."""

    request: ChatCompletionRequest
    prompt_ids: list[int]
    tools: Optional[ToolPlan]
    grammar: Optional[RequestGrammar]
    reasoning: Optional[ReasoningSection] = None

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.parses_calls

    @property
    def repeated_calls_stop(self) -> Optional[ToolFormat]:
        """The tool format whose repeated calls end a choice, unless the request turned that off."""
        return self.tools.format if self.parses_calls and self.request.stop_repeated_tool_calls else None

    def tool_outputs(self) -> list[Optional[ChoiceToolOutput]]:
        """Per choice, the parser of its tool calls (None: plain text)."""
        return [ChoiceToolOutput(self.tools) if self.parses_calls else None for _ in range(self.request.n)]

    def splitters(self) -> list[Optional[ReasoningSplitter]]:
        """Per choice, the splitter of its thinking from its answer (None: no thinking section)."""
        return [self.reasoning.splitter() if self.reasoning else None for _ in range(self.request.n)]


async def plan_chat(request: ChatCompletionRequest, runtime: ModelRuntime) -> ChatPlan:
    """Validate a chat request (400 naming the field) and render its prompt: chat and responses share it."""
    check_request(request, runtime)
    request = with_template_switch(request)
    tools = request_tool_plan(request, runtime)
    prompt_ids = await chat_prompt_ids(request, runtime, tools)
    reasoning = request_section(request, runtime, [prompt_ids], "messages")
    answer = await build_request_grammar(request, runtime)
    grammar = with_thinking(reasoning, await tool_constraint(tools, answer, runtime) or answer, runtime)
    if keeps_special_tokens(tools, runtime.tokenizer):
        request = request.model_copy(update={"skip_special_tokens": False})
    return ChatPlan(request, prompt_ids, tools, grammar, reasoning)


async def create_chat_completion(request: ChatCompletionRequest, runtime: ModelRuntime, raw_request: Request) -> Response:
    plan = await plan_chat(request, runtime)
    writer = _ChatWriter(plan, runtime)
    return await serve(raw_request, runtime, plan.request, [plan.prompt_ids], random_id("chatcmpl"), writer,
                       stream=request.stream, grammar=plan.grammar, repeated_calls_stop=plan.repeated_calls_stop)


class _ChatWriter(DoneTerminatedWriter):
    def __init__(self, plan: ChatPlan, runtime: ModelRuntime):
        self.plan = plan
        self.runtime = runtime
        self.outputs = plan.tool_outputs()
        self.splitters = plan.splitters()

    def body(self, generation: Generation, results: list[ChoiceResult]) -> dict[str, Any]:
        outputs, splitters, runtime = self.outputs, self.splitters, self.runtime
        return ChatCompletionResponse(
            id=generation.response_id,
            model=runtime.model_name,
            choices=[
                ChatCompletionResponseChoice(index=i, message=_message(outputs[i], splitters[i], r.text),
                                             finish_reason=_finish_reason(outputs[i], r.finish_reason),
                                             logprobs=chat_logprobs(runtime, r.token_ids, r.logprobs))
                for i, r in enumerate(results)
            ],
            usage=UsageInfo.of(generation.prompt_tokens, completion_tokens(results), generation.cached_tokens),
        ).model_dump()

    def events(self, generation: Generation) -> AsyncIterator[str]:
        options = self.plan.request.stream_options
        include_usage = options is not None and options.include_usage
        return _stream(generation, self.runtime, self.outputs, self.splitters, include_usage)


def _message(tools: Optional[ChoiceToolOutput], splitter: Optional[ReasoningSplitter], text: str) -> ChatMessage:
    thinking, text = splitter.split(text) if splitter is not None else (None, text)
    message = ChatMessage(content=text) if tools is None else tools.message(text)
    message.reasoning_content = thinking
    return message


def _delta(tools: Optional[ChoiceToolOutput], splitter: Optional[ReasoningSplitter], update: ChoiceUpdate
           ) -> DeltaMessage:
    finished = update.finish_reason is not None
    thinking, text = splitter.feed(update.text, finished) if splitter is not None else ("", update.text)
    delta = DeltaMessage(content=text or None) if tools is None else tools.delta(text, finished=finished)
    delta.reasoning_content = thinking or None
    return delta


def _finish_reason(tools: Optional[ChoiceToolOutput], finish_reason: Optional[str]) -> Optional[str]:
    return finish_reason if tools is None else tools.finish_reason(finish_reason)


async def _stream(generation: Generation, runtime: ModelRuntime, tools: list[Optional[ChoiceToolOutput]],
                  splitters: list[Optional[ReasoningSplitter]], include_usage: bool) -> AsyncIterator[str]:
    """`tools[i]` parses choice i's calls (None: plain text); `splitters[i]` its thinking (None: none)."""
    updates, response_id = generation.updates, generation.response_id
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
            if (tools[update.index] is None and splitters[update.index] is None and update.text
                    and update.logprobs is None and update.finish_reason is None):
                yield text_events[update.index](update.text)
                continue
            delta = _delta(tools[update.index], splitters[update.index], update)
            logprobs = chat_logprobs(runtime, update.token_ids, update.logprobs)
            finish_reason = _finish_reason(tools[update.index], update.finish_reason)
            if delta.is_empty() and logprobs is None and finish_reason is None:
                continue  # tool-call markup or a marker only: nothing to tell the client yet
            yield sse_event(chunk([ChatCompletionResponseStreamChoice(
                index=update.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)]))
        if include_usage:
            yield sse_event(chunk([], UsageInfo.of(generation.prompt_tokens, sum(completion_tokens),
                                                   generation.cached_tokens)))
    finally:
        await close_quietly(updates)
