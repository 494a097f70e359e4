"""Tool calling: model-family call formats, request validation, grammars, streaming parsers."""

from llgtrt_core.tools.formats import GENERIC_JSON, HERMES, LLAMA3_JSON, MISTRAL, TOOL_FORMATS, ToolFormat, detect_tool_format
from llgtrt_core.tools.grammar import arguments_grammar, tool_grammar
from llgtrt_core.tools.parser import ArgumentsDelta, CallStart, ContentDelta, ToolCallParser, ToolEvent
from llgtrt_core.tools.prompt import template_inputs
from llgtrt_core.tools.spec import ToolPlan, ToolRequestError, ToolSpec, plan_tools

__all__ = [
    "GENERIC_JSON", "HERMES", "LLAMA3_JSON", "MISTRAL", "TOOL_FORMATS",
    "ArgumentsDelta", "CallStart", "ContentDelta", "ToolCallParser", "ToolEvent", "ToolFormat", "ToolPlan",
    "ToolRequestError", "ToolSpec", "arguments_grammar", "detect_tool_format", "plan_tools", "template_inputs",
    "tool_grammar",
]
