"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat code.

A Messages request becomes the chat request it means (`system` and the blocks as messages,
`tool_use` / `tool_result` blocks as tool calls and tool messages, `input_schema` as the tool's
parameters, `tool_choice` any/tool as required/named, `thinking` as max_reasoning_tokens), so the
prompt, the constrained tool calls and the thinking section go through the chat code and the one
generation skeleton. The output is built by one `_OutputBuilder` for the streamed events and the
whole message alike. Every error, a refusal before the stream or an event after it, has Anthropic's
shape: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llgtrt_core.api.chat import ChatPlan, plan_chat
from llgtrt_core.api.errors import APIError, validation_error
from llgtrt_core.api.generation import ChoiceResult
from llgtrt_core.api.messages_protocol import (ERROR_TYPES, CountTokensRequest, MessageObject, MessagesRequest,
                                               OutputText, OutputThinking, OutputToolUse, RedactedThinkingBlock,
                                               TextBlock, ThinkingBlock, TokenCount, ToolResultBlock, ToolUseBlock,
                                               Usage)
from llgtrt_core.api.prompts import chat_prompt_ids
from llgtrt_core.api.protocol import ChatCompletionRequest, ErrorInfo
from llgtrt_core.api.reasoning import with_template_switch
from llgtrt_core.api.sampling import check_request
from llgtrt_core.api.serving import Generation, serve
from llgtrt_core.api.tool_calls import ChoiceToolOutput, request_tool_plan
from llgtrt_core.reasoning import ReasoningSplitter
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.stop_strings import StopStringMatcher
from llgtrt_core.tools import ArgumentsDelta, CallStart, ContentDelta

GetRuntime = Callable[[], Awaitable[ModelRuntime]]
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}  # -> reasoning_effort


def anthropic_error(status_code: int, message: str) -> JSONResponse:
    error_type = ERROR_TYPES.get(status_code, "api_error")
    return JSONResponse({"type": "error", "error": {"type": error_type, "message": message}}, status_code=status_code)


def _message(error: APIError) -> str:
    """Anthropic's errors have no `param`: the message names the field."""
    info = error.info
    return f"{info.param}: {info.message}" if info.param and info.param not in info.message else info.message


async def create_message(raw_request: Request, get_runtime: GetRuntime) -> Response:
    try:
        request = await _parsed(raw_request, MessagesRequest)
        runtime = await get_runtime()
        plan = await plan_chat(_chat_request(request), runtime)
        writer = _MessagesWriter(plan, runtime, request)
        return await serve(raw_request, runtime, plan.request, [plan.prompt_ids], writer.message.id, writer,
                           stream=request.stream, grammar=plan.grammar, repeated_calls_stop=plan.repeated_calls_stop)
    except APIError as e:
        return anthropic_error(e.status_code, _message(e))


async def count_tokens(raw_request: Request, get_runtime: GetRuntime) -> Response:
    """The prompt's tokens as /v1/messages would render it (tools and template switches included)."""
    try:
        request = await _parsed(raw_request, CountTokensRequest)
        runtime = await get_runtime()
        chat = with_template_switch(_chat_request(request))
        check_request(chat, runtime)
        prompt_ids = await chat_prompt_ids(chat, runtime, request_tool_plan(chat, runtime))
        return JSONResponse(TokenCount(input_tokens=len(prompt_ids)).model_dump())
    except APIError as e:
        return anthropic_error(e.status_code, _message(e))


async def _parsed(raw_request: Request, model: type[CountTokensRequest]) -> Any:
    try:
        return model.model_validate_json(await raw_request.body())
    except pydantic.ValidationError as e:
        info = validation_error(e.errors())
        raise APIError(info.message, param=info.param) from e


# --------------------------------------------------------------------------- request -> chat request


def _chat_request(request: Union[MessagesRequest, CountTokensRequest]) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        system = request.system if isinstance(request.system, str) else "\n".join(b.text for b in request.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        messages += _chat_messages(message.role, message.content, f"messages[{i}]")
    fields: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.input_schema, "strict": t.strict}}
                           for t in request.tools]
    if request.tool_choice is not None:
        fields.update(_tool_choice(request))
    if isinstance(request, MessagesRequest):
        fields.update(max_completion_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                      top_k=request.top_k, stream=request.stream, stop=request.stop_sequences,
                      # the stop sequence stays in the text so the writer can name it (and then cuts it)
                      include_stop_str_in_output=bool(request.stop_sequences))
    fields["max_reasoning_tokens"] = _reasoning_budget(request)
    output = request.output_config
    if output is not None and output.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": output.format.schema_}}
    if output is not None and output.effort is not None and request.thinking is None:
        fields["reasoning_effort"] = _EFFORTS[output.effort]
    try:
        return ChatCompletionRequest(**fields)
    except pydantic.ValidationError as e:
        info = validation_error(e.errors())
        raise APIError(info.message, param=info.param) from e


def _chat_messages(role: str, content: Any, param: str) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: a user turn's tool results first (tool messages), then its text;
    an assistant turn's text and tool calls as one message. Past thinking is left out, as chat templates do."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock) and role == "assistant":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock) and role == "user":
            text = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content or [])
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)) and role == "assistant":
            continue
        else:
            raise APIError(f"content blocks of type {block.type!r} are not supported in a {role} message by this "
                           f"server", param=f"{where}.type")
    turn: list[dict[str, Any]] = []
    if texts or calls or not results:
        message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        turn.append(message)
    return results + turn


def _tool_choice(request: Union[MessagesRequest, CountTokensRequest]) -> dict[str, Any]:
    choice = request.tool_choice
    assert choice is not None
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use is not None and choice.type != "none":
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise APIError("tool_choice.name: required when tool_choice.type is tool", param="tool_choice.name")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def _reasoning_budget(request: Union[MessagesRequest, CountTokensRequest]) -> Optional[int]:
    """`thinking` as max_reasoning_tokens: enabled -> its budget, disabled -> 0, adaptive, between_tools or
    absent -> the server's default (a reasoning model thinks unless told not to)."""
    thinking = request.thinking
    if thinking is None or thinking.type in ("adaptive", "between_tools"):
        return None
    if thinking.type == "disabled":
        return 0
    if thinking.budget_tokens is None:
        raise APIError("thinking.budget_tokens: required when thinking.type is enabled", param="thinking.budget_tokens")
    if isinstance(request, MessagesRequest) and thinking.budget_tokens >= request.max_tokens:
        raise APIError(f"`max_tokens` must be greater than `thinking.budget_tokens` ({thinking.budget_tokens})",
                       param="thinking.budget_tokens")
    return thinking.budget_tokens


# --------------------------------------------------------------------------- output


class _OutputBuilder:
    """The message's content blocks, built from the generated text; returns the stream events that tell it.

    The text goes through the stop sequences (cut, and named in `stop_sequence`), the thinking splitter
    (a thinking block) and the tool parser (text and tool_use blocks); a block closes when another opens.
    """

    def __init__(self, message: MessageObject, tools: Optional[ChoiceToolOutput],
                 splitter: Optional[ReasoningSplitter], stop_sequences: list[str]):
        self.message = message
        self.tools = tools
        self.splitter = splitter
        self._stops = StopStringMatcher(stop_sequences)
        self._stop_sequences = stop_sequences
        self._tail = ""  # the raw text's end, where a stop sequence that matched is
        self._block: Union[OutputThinking, OutputText, OutputToolUse, None] = None
        self._arguments = ""  # the open tool_use block's input, as JSON text

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        if self._stops.stopped:
            return []
        if self._stop_sequences:
            self._tail = (self._tail + text)[-max(len(s) for s in self._stop_sequences):]
        text = self._stops.feed(text)
        if self._stops.stopped:
            finished = True
            self.message.stop_sequence = next(s for s in self._stop_sequences if self._tail.endswith(s))
        elif finished:
            text += self._stops.flush()
        events: list[dict[str, Any]] = []
        if self.splitter is not None:
            thinking, text = self.splitter.feed(text, finished)
            if thinking:
                events += self._delta(OutputThinking, {"type": "thinking_delta", "thinking": thinking})
        parsed = self.tools.events(text, finished) if self.tools is not None else [ContentDelta(text)] if text else []
        for event in parsed:
            if isinstance(event, ContentDelta) and event.text:
                events += self._delta(OutputText, {"type": "text_delta", "text": event.text})
            elif isinstance(event, CallStart):
                assert self.tools is not None
                events += self.close()
                events += self._open(OutputToolUse(id=self.tools.call_id(event.index), name=event.name))
            elif isinstance(event, ArgumentsDelta) and isinstance(self._block, OutputToolUse):
                self._arguments += event.text
                events.append(self._event("content_block_delta",
                                          delta={"type": "input_json_delta", "partial_json": event.text}))
        return events

    def finish(self, finish_reason: Optional[str], output_tokens: int) -> list[dict[str, Any]]:
        events = self.close()
        message = self.message
        if message.stop_sequence is not None:
            message.stop_reason = "stop_sequence"
        elif finish_reason == "length":
            message.stop_reason = "max_tokens"
        else:
            message.stop_reason = "tool_use" if self.tools is not None and self.tools.made_calls else "end_turn"
        message.usage.output_tokens = output_tokens
        return events

    def close(self) -> list[dict[str, Any]]:
        if self._block is None:
            return []
        if isinstance(self._block, OutputToolUse):
            try:
                self._block.input = json.loads(self._arguments or "{}")
            except json.JSONDecodeError:  # cut by max_tokens: the input so far is not JSON yet
                self._block.input = {}
            self._arguments = ""
        event = self._event("content_block_stop")
        self._block = None
        return [event]

    def _delta(self, kind: type, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if not isinstance(self._block, kind):
            events += self.close()
            events += self._open(kind())
        if isinstance(self._block, OutputText):
            self._block.text += delta["text"]
        elif isinstance(self._block, OutputThinking):
            self._block.thinking += delta["thinking"]
        events.append(self._event("content_block_delta", delta=delta))
        return events

    def _open(self, block: Union[OutputThinking, OutputText, OutputToolUse]) -> list[dict[str, Any]]:
        self.message.content.append(block)
        self._block = block
        return [self._event("content_block_start", content_block=block.model_dump())]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "index": len(self.message.content) - 1, **fields}


class _MessagesWriter:
    done_event = None  # message_stop ends the stream

    def __init__(self, plan: ChatPlan, runtime: ModelRuntime, request: MessagesRequest):
        self.message = MessageObject(id=f"msg_{uuid.uuid4().hex}", model=runtime.model_name,
                                     usage=Usage(input_tokens=len(plan.prompt_ids), output_tokens=0))
        self.output = _OutputBuilder(self.message, plan.tool_outputs()[0], plan.splitters()[0],
                                     request.stop_sequences or [])

    def body(self, generation: Generation, results: list[ChoiceResult]) -> dict[str, Any]:
        result = results[0]
        self.output.feed(result.text, True)
        self.output.finish(result.finish_reason, result.num_generated_tokens)
        return self.message.model_dump()

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        yield _sse({"type": "message_start", "message": self.message.model_dump()})
        finish_reason, tokens = None, 0
        async for update in generation.updates:
            finish_reason, tokens = update.finish_reason, update.num_generated_tokens
            for event in self.output.feed(update.text, finish_reason is not None):
                yield _sse(event)
        for event in self.output.finish(finish_reason, tokens):
            yield _sse(event)
        yield _sse({"type": "message_delta", "delta": {"stop_reason": self.message.stop_reason,
                                                       "stop_sequence": self.message.stop_sequence},
                    "usage": {"output_tokens": tokens}})
        yield _sse({"type": "message_stop"})

    def error_event(self, info: ErrorInfo) -> str:
        error_type = "overloaded_error" if info.type == "service_unavailable" else (
            "invalid_request_error" if info.type == "invalid_request_error" else "api_error")
        return _sse({"type": "error", "error": {"type": error_type, "message": info.message}})


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
