"""Tools and past calls into the chat template's inputs.

Templates that know tools get the OpenAI `tools` list and the history as is. For a template that
knows none (GENERIC_JSON), the tools are described in the system message, and past calls and
tool results become text in the call format the model is asked to write.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from llgtrt_core.tools.formats import ToolFormat
from llgtrt_core.tools.spec import ToolPlan


def template_inputs(messages: list[dict[str, Any]], plan: Optional[ToolPlan], tool_format: ToolFormat
                    ) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """(messages, tools) to render; `messages` hold arguments already decoded to mappings."""
    offered = plan is not None and plan.mode != "none"
    if tool_format.native:
        return messages, [t.as_openai() for t in plan.tools] if offered else None
    rendered = [_as_text_turn(m, tool_format) for m in messages]
    if offered:
        assert plan is not None
        rendered = _with_system_text(rendered, describe_tools(plan))
    return rendered, None


def describe_tools(plan: ToolPlan) -> str:
    fmt = plan.format
    lines = ["You can call these tools; their parameters are JSON schemas:"]
    lines += [json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in plan.tools]
    example = fmt.render_calls([("<tool name>", "{<arguments>}")])
    lines += ["To call a tool, answer with:", example]
    if plan.mode == "required":
        lines.append("You must call at least one tool.")
    elif plan.mode == "named":
        lines.append(f"Call the tool {plan.forced_name}.")
    return "\n".join(lines)


def _as_text_turn(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls"):
        calls = [(c["function"]["name"], _arguments_text(c["function"].get("arguments")))
                 for c in message["tool_calls"]]
        text = "\n".join(t for t in (message.get("content") or "", fmt.render_calls(calls)) if t)
        return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
    if role in ("tool", "function"):
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    return message


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    first = messages[0] if messages else None
    if first is not None and first.get("role") in ("system", "developer") and isinstance(first.get("content"), str):
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
