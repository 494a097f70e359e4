"""The tools of one request, validated: which may be called, how, and how often.

`tools`/`tool_choice` and the legacy `functions`/`function_call` both become one `ToolPlan`;
every mistake is a `ToolRequestError` naming the request field (the API answers 400, as it does
for every `GrammarRequestError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from llgtrt_core.constraints.errors import GrammarRequestError
from llgtrt_core.tools.formats import ToolFormat

ToolMode = Literal["none", "auto", "required", "named"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolRequestError(GrammarRequestError):
    """The request's tools cannot be honoured (bad name, schema, choice)."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: Optional[str]
    parameters: dict[str, Any]  # JSON schema of the arguments object
    param: str  # where it came from in the request, e.g. "tools[0].function"

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI tool object, as chat templates expect `tools` entries."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[ToolSpec, ...]
    mode: ToolMode
    forced_name: Optional[str]  # the named choice
    parallel: bool  # more than one call allowed
    legacy: bool  # `functions` API: answer with message.function_call
    format: ToolFormat

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    @property
    def callable_tools(self) -> tuple[ToolSpec, ...]:
        if self.forced_name is None:
            return self.tools
        return tuple(t for t in self.tools if t.name == self.forced_name)

    def finish_reason(self, finish_reason: str, made_calls: bool) -> str:
        """OpenAI: `tool_calls` for auto/required calls, `stop` for a named choice."""
        if finish_reason != "stop" or not made_calls or self.mode == "named":
            return finish_reason
        return "function_call" if self.legacy else "tool_calls"


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _spec(function: Any, param: str) -> ToolSpec:
    name = _get(function, "name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolRequestError(f"{param}.name", "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    parameters = _get(function, "parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolRequestError(f"{param}.parameters", "must be a JSON schema of type object")
    return ToolSpec(name, _get(function, "description"), parameters, param)


def plan_tools(request: Any, tool_format: ToolFormat) -> Optional[ToolPlan]:
    """The request's tool plan; None when it declares no tools (and asks for none)."""
    tools, functions = _get(request, "tools"), _get(request, "functions")
    tool_choice, function_call = _get(request, "tool_choice"), _get(request, "function_call")
    if tools and functions:
        raise ToolRequestError("functions", "give tools or the deprecated functions, not both")
    legacy = bool(functions) or (not tools and function_call is not None)
    choice, choice_param = (function_call, "function_call") if legacy else (tool_choice, "tool_choice")
    declared = functions if legacy else tools
    if not declared:
        if choice not in (None, "none"):
            raise ToolRequestError(choice_param, f"{choice_param} is only allowed when "
                                                 f"{'functions are' if legacy else 'tools are'} specified")
        return None
    if legacy:
        specs = [_spec(f, f"functions[{i}]") for i, f in enumerate(declared)]
    else:
        specs = [_spec(_get(t, "function"), f"tools[{i}].function") for i, t in enumerate(declared)]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolRequestError(specs[names.index(duplicates[0])].param + ".name",
                               f"tool names must be unique; {duplicates[0]!r} is declared twice")
    forced_name = None
    if choice is None:
        mode: ToolMode = "auto"
    elif isinstance(choice, str):
        mode = choice  # type: ignore[assignment]
    else:
        forced_name = _get(choice, "name") if legacy else _get(_get(choice, "function"), "name")
        if forced_name not in names:
            raise ToolRequestError(choice_param, f"{forced_name!r} is not one of the declared "
                                                 f"{'functions' if legacy else 'tools'}: {', '.join(names)}")
        mode = "named"
    parallel = not legacy and mode != "named" and _get(request, "parallel_tool_calls") is not False
    return ToolPlan(tuple(specs), mode, forced_name, parallel, legacy, tool_format)
