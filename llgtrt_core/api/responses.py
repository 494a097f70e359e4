"""POST /v1/responses, and GET / DELETE / cancel of stored responses.

A Responses request becomes the chat request it means (instructions and input items as messages,
`text.format` as `response_format`, function tools as chat tools), so the prompt, the tools and the
constraint go through the chat code; a 400 names the Responses field (`input[2].content`,
`tools[0].parameters`, `text.format`). The output is built by one `_OutputBuilder` for both the
streamed events and the whole response, so the two always agree.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llgtrt_core.api.chat import ChatPlan, plan_chat
from llgtrt_core.api.errors import APIError
from llgtrt_core.api.generation import ChoiceResult
from llgtrt_core.api.logprobs import chat_logprobs
from llgtrt_core.api.protocol import ChatCompletionRequest, ErrorInfo, now
from llgtrt_core.api.response_store import ResponseStore, StoredResponse
from llgtrt_core.api.responses_protocol import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputItem,
    MessageItem,
    Unsupported,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningItem,
    OutputTextLogprob,
    OutputTextPart,
    ReasoningText,
    Refusal,
    ResponseDeleted,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    ToolChoiceFunction,
)
from llgtrt_core.api.serving import Generation, GenerationStopped, completion_tokens, serve
from llgtrt_core.api.tool_calls import ChoiceToolOutput
from llgtrt_core.reasoning import ReasoningSplitter
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tools import ArgumentsDelta, CallStart, ContentDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesAPI:
    """The Responses routes of one app, over its store of responses."""

    def __init__(self, store: ResponseStore):
        self.store = store

    async def create(self, request: ResponsesRequest, runtime: ModelRuntime, raw_request: Request) -> Response:
        _refuse_unsupported(request)
        previous = self._previous_items(request)
        items = previous + _request_items(request)
        chat, params = _chat_request(request, items, len(previous))
        response = _new_response(request, runtime.model_name)
        entry = StoredResponse(response, items)
        try:
            plan = await plan_chat(chat, runtime)
            writer = _ResponsesWriter(plan, runtime, response, self.store if request.store else None, entry)
            if request.store:
                self.store.put(entry)
            return await serve(raw_request, runtime, plan.request, [plan.prompt_ids], response.id, writer,
                               stream=request.stream, grammar=plan.grammar, stop=entry.stop,
                               repeated_calls_stop=plan.repeated_calls_stop)
        except GenerationStopped:  # cancelled while collecting: the response says so
            writer.store_end()
            return JSONResponse(response.model_dump())
        except APIError as e:
            if response.status == "in_progress":
                self.store.delete(response.id)  # refused before it started: never existed
            e.info.param = params.translate(e.info.param)
            raise

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._stored(response_id).response.model_dump()

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return ResponseDeleted(id=response_id).model_dump()

    def cancel(self, response_id: str) -> dict[str, Any]:
        entry = self.store.cancel(response_id)
        if entry is None:
            raise _not_found(response_id)
        if entry.response.status != "cancelled":
            raise APIError(f"Cannot cancel a response with status {entry.response.status!r}; only one in "
                           f"progress can be cancelled.", param="response_id", code="response_not_cancellable")
        return entry.response.model_dump()

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry

    def _previous_items(self, request: ResponsesRequest) -> list[InputItem]:
        """The conversation `previous_response_id` ends: its input, then its output, as items."""
        if request.previous_response_id is None:
            return []
        entry = self.store.get(request.previous_response_id)
        if entry is None:
            raise APIError(f"Previous response with id '{request.previous_response_id}' not found (responses are "
                           f"kept for a while, per replica).", status_code=404,
                           param="previous_response_id", code="previous_response_not_found")
        if entry.response.status == "in_progress":
            raise APIError("the previous response is still in progress", param="previous_response_id")
        return entry.input_items + [_as_input_item(item) for item in entry.response.output]


def _not_found(response_id: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", status_code=404, param="response_id",
                    code="response_not_found")


# --------------------------------------------------------------------------- request -> chat request


def _refuse_unsupported(request: ResponsesRequest) -> None:
    unsupported = request.unsupported_params()
    if unsupported:
        raise APIError(f"unsupported parameter(s): {', '.join(unsupported)} (not implemented by this server)",
                       param=unsupported[0], code="unsupported_parameter")
    for i, tool in enumerate(request.tools or []):
        if not isinstance(tool, FunctionTool):
            raise APIError(f"the hosted tool {tool.type!r} is not available on this server; declare function tools "
                           f"and run them yourself", param=f"tools[{i}].type", code="unsupported_tool")
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, (str, ToolChoiceFunction)):
        raise APIError(f"tool_choice of type {choice.type!r} is not supported; use none, auto, required or a "
                       f"function", param="tool_choice.type", code="unsupported_parameter")


def _request_items(request: ResponsesRequest) -> list[InputItem]:
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    return list(request.input)


class _Params:
    """Chat parameter names (in a 400 from the chat code) -> the Responses request's."""

    def __init__(self, message_params: list[str]):
        self.message_params = message_params

    def translate(self, param: Optional[str]) -> Optional[str]:
        if param is None:
            return None
        if param.startswith("messages["):
            index, _, rest = param[len("messages["):].partition("]")
            return self.message_params[int(index)] + rest
        if param.startswith("response_format"):
            return "text.format"
        if param.startswith("tools[") and ".function" in param:
            return param.replace(".function", "", 1)
        renamed = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                   "reasoning_effort": "reasoning.effort"}
        return renamed.get(param, param)


def _chat_request(request: ResponsesRequest, items: list[InputItem], num_previous: int
                  ) -> tuple[ChatCompletionRequest, _Params]:
    messages: list[dict[str, Any]] = []
    params: list[str] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        params.append("instructions")
    for i, item in enumerate(items):
        if i < num_previous:
            param = "previous_response_id"
        else:
            param = "input" if isinstance(request.input, str) else f"input[{i - num_previous}]"
        if isinstance(item, ReasoningItem):
            continue  # past thinking stays out of the prompt, as chat templates leave it out
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content, f"{param}.content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # text and calls of one turn: one message
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"{param}.output")})
        else:
            raise APIError(f"input items of type {item.type!r} are not supported by this server", param=f"{param}.type")
        params.append(param)
    chat = ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        logprobs=request.wants_logprobs,
        top_logprobs=request.top_logprobs if request.wants_logprobs else None,
        tools=[{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters, "strict": t.strict}}
               for t in request.tools or []] or None,
        tool_choice=({"type": "function", "function": {"name": request.tool_choice.name}}
                     if isinstance(request.tool_choice, ToolChoiceFunction) else request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request),
        reasoning_effort=request.reasoning.effort if request.reasoning is not None else None,
        user=request.user,
        stream=request.stream,
    )
    return chat, _Params(params)


def _text(content: Union[str, list[ContentPart]], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, Unsupported):
            raise APIError(f"content parts of type {part.type!r} are not supported by this model; send text",
                           param=f"{param}[{j}]")
        texts.append(part.refusal if isinstance(part, Refusal) else part.text)
    return "\n".join(texts)


def _response_format(request: ResponsesRequest) -> Optional[dict[str, Any]]:
    form = request.text.format if request.text is not None else None
    if isinstance(form, TextFormatJsonSchema):
        return {"type": "json_schema", "json_schema": {"name": form.name, "description": form.description,
                                                       "schema": form.schema_, "strict": form.strict}}
    if isinstance(form, TextFormatJsonObject):
        return {"type": "json_object"}
    return None


def _as_input_item(item: Union[OutputReasoning, OutputMessage, OutputFunctionCall]) -> InputItem:
    if isinstance(item, OutputReasoning):
        return ReasoningItem(type="reasoning", id=item.id, content=[c.model_dump() for c in item.content])
    if isinstance(item, OutputMessage):
        return MessageItem(role="assistant", content=[OutputText(type="output_text", text=p.text) for p in item.content])
    return FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments)


def _new_response(request: ResponsesRequest, model: str) -> ResponseObject:
    text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else {}
    return ResponseObject(
        id=new_id("resp"), model=model, instructions=request.instructions,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        tool_choice=request.tool_choice.model_dump() if isinstance(request.tool_choice, BaseModel)
        else request.tool_choice or "auto",
        tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
        text={"format": {"type": "text"}, **text},
        temperature=request.temperature, top_p=request.top_p, top_logprobs=request.top_logprobs,
        max_output_tokens=request.max_output_tokens, previous_response_id=request.previous_response_id,
        store=request.store, metadata=request.metadata or {}, user=request.user,
    )


# --------------------------------------------------------------------------- output


class _OutputBuilder:
    """The response's output items, built from the generated text; returns the events that tell it.

    Events are dicts without `sequence_number` (the stream numbers them). A message item opens on
    the first text, a function_call item on each call; the previous item closes when another opens.
    """

    def __init__(self, response: ResponseObject, tools: Optional[ChoiceToolOutput],
                 splitter: Optional[ReasoningSplitter] = None):
        self.response = response
        self.tools = tools
        self.splitter = splitter
        self._reasoning: Optional[OutputReasoning] = None
        self._message: Optional[OutputMessage] = None
        self._call: Optional[OutputFunctionCall] = None

    def feed(self, text: str, finished: bool, logprobs: list[OutputTextLogprob]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.splitter is not None:
            thinking, text = self.splitter.feed(text, finished)
            if thinking:
                events += self._thinking(thinking)
        if self.tools is None:
            parsed = [ContentDelta(text)] if text else []
        else:
            parsed = self.tools.events(text, finished)
        for event in parsed:
            if isinstance(event, ContentDelta) and event.text:
                events += self._text(event.text, logprobs)
                logprobs = []  # the update's tokens go with its first text
            elif isinstance(event, CallStart):
                assert self.tools is not None
                events += self.close("completed")
                self._call = OutputFunctionCall(id=new_id("fc"), call_id=self.tools.call_id(event.index),
                                                name=event.name)
                events.append(self._added(self._call))
            elif isinstance(event, ArgumentsDelta) and self._call is not None:
                self._call.arguments += event.text
                events.append({"type": "response.function_call_arguments.delta", "item_id": self._call.id,
                               "output_index": self._index(), "delta": event.text})
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (if any) with `status`."""
        events: list[dict[str, Any]] = []
        if self._reasoning is not None:
            item, text = self._reasoning, self._reasoning.content[0].text
            events.append({"type": "response.reasoning_text.done", "item_id": item.id, "output_index": self._index(),
                           "content_index": 0, "text": text})
            item.status = status  # type: ignore[assignment]
            events.append({"type": "response.output_item.done", "output_index": self._index(), "item": item.model_dump()})
            self._reasoning = None
        if self._message is not None:
            item, part = self._message, self._message.content[0]
            base = {"item_id": item.id, "output_index": self._index(), "content_index": 0}
            events.append({"type": "response.output_text.done", **base, "text": part.text,
                           "logprobs": [lp.model_dump() for lp in part.logprobs]})
            events.append({"type": "response.content_part.done", **base, "part": part.model_dump()})
            item.status = status  # type: ignore[assignment]
            events.append({"type": "response.output_item.done", "output_index": self._index(), "item": item.model_dump()})
            self._message = None
        if self._call is not None:
            call = self._call
            events.append({"type": "response.function_call_arguments.done", "item_id": call.id,
                           "output_index": self._index(), "name": call.name, "arguments": call.arguments})
            call.status = status  # type: ignore[assignment]
            events.append({"type": "response.output_item.done", "output_index": self._index(), "item": call.model_dump()})
            self._call = None
        return events

    def _index(self) -> int:
        return len(self.response.output) - 1  # the open item is the last one

    def _added(self, item: Union[OutputReasoning, OutputMessage, OutputFunctionCall]) -> dict[str, Any]:
        self.response.output.append(item)
        return {"type": "response.output_item.added", "output_index": self._index(), "item": item.model_dump()}

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._reasoning is None:
            self._reasoning = OutputReasoning(id=new_id("rs"), content=[ReasoningText()])
            events.append(self._added(self._reasoning))
        self._reasoning.content[0].text += text
        events.append({"type": "response.reasoning_text.delta", "item_id": self._reasoning.id,
                       "output_index": self._index(), "content_index": 0, "delta": text})
        return events

    def _text(self, text: str, logprobs: list[OutputTextLogprob]) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            events += self.close("completed")
            self._message = OutputMessage(id=new_id("msg"))
            events.append(self._added(self._message))
            part = OutputTextPart()
            self._message.content.append(part)
            events.append({"type": "response.content_part.added", "item_id": self._message.id,
                           "output_index": self._index(), "content_index": 0, "part": part.model_dump()})
        part = self._message.content[0]
        part.text += text
        part.logprobs += logprobs
        events.append({"type": "response.output_text.delta", "item_id": self._message.id,
                       "output_index": self._index(), "content_index": 0, "delta": text,
                       "logprobs": [lp.model_dump() for lp in logprobs]})
        return events


class _ResponsesWriter:
    done_event = None  # the terminal response.* event ends the stream

    def __init__(self, plan: ChatPlan, runtime: ModelRuntime, response: ResponseObject,
                 store: Optional[ResponseStore], entry: StoredResponse):
        self.runtime = runtime
        self.response = response
        self.store = store
        self.entry = entry
        self.output = _OutputBuilder(response, plan.tool_outputs()[0], plan.splitters()[0])
        self._sequence_number = 0

    def body(self, generation: Generation, results: list[ChoiceResult]) -> dict[str, Any]:
        result = results[0]
        self.output.feed(result.text, True, self._logprobs(result.token_ids, result.logprobs))
        self._finish(generation, result.finish_reason, completion_tokens(results))
        return self.response.model_dump()

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        yield self._event({"type": "response.created", "response": self.response.model_dump()})
        yield self._event({"type": "response.in_progress", "response": self.response.model_dump()})
        finish_reason, tokens = None, 0
        try:
            async for update in generation.updates:
                finish_reason, tokens = update.finish_reason, update.num_generated_tokens
                logprobs = self._logprobs(update.token_ids, update.logprobs)
                for event in self.output.feed(update.text, finish_reason is not None, logprobs):
                    yield self._event(event)
            for event in self._finish(generation, finish_reason, tokens):
                yield self._event(event)
            yield self._event({"type": f"response.{self.response.status}", "response": self.response.model_dump()})
        except (GeneratorExit, asyncio.CancelledError):  # the client went away (a failure goes to error_event)
            if self.response.status == "in_progress":
                self.response.status = "cancelled"
                self.store_end()
            raise

    def error_event(self, info: ErrorInfo) -> str:
        """The events ending a stream that failed (or was cancelled) after its 200."""
        events = [self._event(e) for e in self.output.close("incomplete")]
        if info.code == GenerationStopped.CODE:
            self.response.status = "cancelled"
        else:
            self.response.status = "failed"
            self.response.error = ResponseError(code=info.code or info.type, message=info.message)
            events.append(self._event({"type": "error", "code": info.code or info.type, "message": info.message,
                                       "param": info.param}))
        self.store_end()
        events.append(self._event({"type": "response.failed", "response": self.response.model_dump()}))
        return "".join(events)

    def _finish(self, generation: Generation, finish_reason: Optional[str], tokens: int) -> list[dict[str, Any]]:
        incomplete = finish_reason == "length"
        events = self.output.close("incomplete" if incomplete else "completed")
        response = self.response
        if response.status == "in_progress":  # not cancelled meanwhile
            response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        response.completed_at = now()
        response.usage = ResponseUsage.of(generation.prompt_tokens, tokens, generation.cached_tokens)
        self.store_end()
        return events

    def store_end(self) -> None:
        """Store the response as it ended (its age counts from now; a cancel made meanwhile wins)."""
        if self.store is not None:
            self.store.put(self.entry)

    def _logprobs(self, token_ids: Any, logprobs: Any) -> list[OutputTextLogprob]:
        scored = chat_logprobs(self.runtime, token_ids, logprobs)
        if scored is None or scored.content is None:
            return []
        return [OutputTextLogprob(token=lp.token, bytes=lp.bytes, logprob=lp.logprob, top_logprobs=lp.top_logprobs)
                for lp in scored.content]

    def _event(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self._sequence_number
        self._sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
