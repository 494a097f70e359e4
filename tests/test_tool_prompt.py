"""Tools and past calls into the template: as-is for templates that know tools, as text in the
call format for templates that do not (the generic JSON fallback)."""

from __future__ import annotations

import json

from llgtrt_core.chat_template import ChatTemplate
from llgtrt_core.tools import GENERIC_JSON, HERMES, CallStart, ToolCallParser, plan_tools, template_inputs

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
]
# A small template of the Hermes kind: it renders tools, past calls and tool results itself.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}\n{% endfor %}"
)


def test_native_template_gets_tools_and_history_as_is() -> None:
    plan = plan_tools({"tools": [WEATHER]}, HERMES)
    messages, tools = template_inputs(HISTORY, plan, HERMES)
    assert messages == HISTORY
    assert tools == [WEATHER]
    text = ChatTemplate(TOOL_TEMPLATE, {}).render(messages, tools=tools, add_generation_prompt=False)
    assert '<tools>{"name": "get_weather"' in text
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text
    assert "[tool]21C" in text


def test_tool_choice_none_shows_no_tools() -> None:
    plan = plan_tools({"tools": [WEATHER], "tool_choice": "none"}, HERMES)
    assert template_inputs(HISTORY, plan, HERMES)[1] is None
    messages, _ = template_inputs(HISTORY[:2], plan_tools({"tools": [WEATHER], "tool_choice": "none"}, GENERIC_JSON),
                                  GENERIC_JSON)
    assert messages == HISTORY[:2]


def test_generic_fallback_describes_tools_and_writes_history_as_text() -> None:
    plan = plan_tools({"tools": [WEATHER], "tool_choice": "required"}, GENERIC_JSON)
    messages, tools = template_inputs(HISTORY, plan, GENERIC_JSON)
    assert tools is None
    system = messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert json.dumps(WEATHER["function"]) in system["content"]
    assert "You must call at least one tool." in system["content"]
    assistant = messages[2]
    assert "tool_calls" not in assistant
    parser = ToolCallParser(GENERIC_JSON)  # the model reads its past calls in the format it writes
    events = parser.feed(assistant["content"]) + parser.finish()
    assert [e.name for e in events if isinstance(e, CallStart)] == ["get_weather"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\n21C\n</tool_response>"}


def test_generic_fallback_adds_a_system_message_when_there_is_none() -> None:
    plan = plan_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                      GENERIC_JSON)
    messages, _ = template_inputs(HISTORY[1:2], plan, GENERIC_JSON)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].endswith("Call the tool get_weather.")
