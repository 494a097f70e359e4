"""Tools in a chat completion: the plan and grammar of a request, and the model's output as
OpenAI `tool_calls` (or legacy `function_call`), whole or as stream deltas.

Streaming follows OpenAI exactly: a call's `id`, `type` and `name` come once, in the first delta
of its index (with `arguments: ""` or a first fragment); later deltas carry the index and an
arguments fragment. The fragments concatenate to the non-streamed arguments, because both go
through the same parser.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from llgtrt_core.api.errors import APIError
from llgtrt_core.api.protocol import (
    ChatCompletionMessageToolCall,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
)
from llgtrt_core.constraints import GrammarCompiler, GrammarRequestError, RequestGrammar
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tokenizer import Tokenizer
from llgtrt_core.tools import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    ToolEvent,
    ToolPlan,
    arguments_grammar,
    plan_tools,
    tool_grammar,
)

TOOLS_PARAM = "tools"  # named by a 400 when the tools grammar fails and no single tool's schema does


def request_tool_plan(request: Any, runtime: ModelRuntime) -> Optional[ToolPlan]:
    """The request's tools, validated (400 naming the field); None when it has none."""
    try:
        return plan_tools(request, runtime.tool_format)
    except GrammarRequestError as e:
        raise APIError(e.message, param=e.param) from e


def keeps_special_tokens(plan: Optional[ToolPlan], tokenizer: Tokenizer) -> bool:
    """A trigger that is an added token (`<|python_tag|>`) must survive detokenization."""
    return plan is not None and plan.parses_calls and plan.format.trigger in tokenizer.hf.get_added_vocab()


async def tool_constraint(plan: Optional[ToolPlan], answer: Optional[RequestGrammar], runtime: ModelRuntime
                          ) -> Optional[RequestGrammar]:
    """The grammar that replaces the request's own (`answer`) while tools may be called: under
    tool_choice auto the answer is one of its branches. Its text is written on a worker thread
    (each tool's schema, as the request's own)."""
    if plan is None or not plan.parses_calls:
        return None
    try:
        text = await asyncio.to_thread(tool_grammar, plan, runtime.tokenizer.hf.get_added_vocab(),
                                       answer.grammar if answer is not None and plan.mode == "auto" else None)
        runtime.grammars.check_length(text, TOOLS_PARAM)
        await compile_tool_grammar(runtime.grammars, plan, text)
    except GrammarRequestError as e:
        raise APIError(e.message, param=e.param) from e
    return RequestGrammar(TOOLS_PARAM, text)


async def compile_tool_grammar(grammars: GrammarCompiler, plan: ToolPlan, text: str) -> None:
    """Compile the tools grammar through the compiler's cache (a repeated tool list compiles
    nothing). When it fails, the first tool whose own arguments grammar fails is named instead."""
    try:
        await grammars.compile(text, TOOLS_PARAM)
    except GrammarRequestError:
        for tool in plan.callable_tools:
            await grammars.compile(json.dumps({"grammars": [arguments_grammar(tool)]}), f"{tool.param}.parameters")
        raise


class ChoiceToolOutput:
    """One choice's output through the tool parser: stream deltas, or the whole message."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._parser = ToolCallParser(plan.format)
        self._ids: list[str] = []

    @property
    def made_calls(self) -> bool:
        return bool(self._ids)

    def call_id(self, index: int) -> str:
        """The id of call `index`, once its CallStart came out of `events`."""
        return self._ids[index]

    def finish_reason(self, finish_reason: Optional[str]) -> Optional[str]:
        return None if finish_reason is None else self.plan.finish_reason(finish_reason, self.made_calls)

    def events(self, text: str, finished: bool) -> list[ToolEvent]:
        events = self._parser.feed(text)
        if finished:
            events += self._parser.finish()
        self._ids += [self.plan.format.new_call_id() for e in events if isinstance(e, CallStart)]
        return events

    def delta(self, text: str, finished: bool) -> DeltaMessage:
        events = self.events(text, finished)
        content = "".join(e.text for e in events if isinstance(e, ContentDelta)) or None
        calls: dict[int, DeltaToolCall] = {}
        for event in events:
            if isinstance(event, CallStart):
                calls[event.index] = DeltaToolCall(index=event.index, id=self._ids[event.index], type="function",
                                                   function=DeltaFunctionCall(name=event.name, arguments=""))
            elif isinstance(event, ArgumentsDelta):
                call = calls.setdefault(event.index,
                                        DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments="")))
                call.function.arguments += event.text
        if self.plan.legacy:
            function_call = next(iter(calls.values())).function if calls else None
            return DeltaMessage(content=content, function_call=function_call)
        return DeltaMessage(content=content, tool_calls=list(calls.values()) or None)

    def message(self, text: str) -> ChatMessage:
        content, calls = [], []
        for event in self.events(text, finished=True):
            if isinstance(event, ContentDelta):
                content.append(event.text)
            elif isinstance(event, CallStart):
                calls.append([event.name, ""])
            else:
                calls[event.index][1] += event.text
        text_content = "".join(content) or None
        if self.plan.legacy:
            function_call = FunctionCall(name=calls[0][0], arguments=calls[0][1]) if calls else None
            return ChatMessage(content=text_content, function_call=function_call)
        tool_calls = [ChatCompletionMessageToolCall(id=self._ids[i], function=FunctionCall(name=name, arguments=args))
                      for i, (name, args) in enumerate(calls)]
        return ChatMessage(content=text_content, tool_calls=tool_calls or None)
