"""Each family's streaming tool-call parser, fed the same output in deltas of every length 1..10.

Whatever the split, the events must add up to the same content and calls, arguments must be
the JSON exactly as written (braces and quotes inside strings included), and no markup may
reach the content.
"""

from __future__ import annotations

import json

import pytest

from llgtrt_core.tools import (
    GENERIC_JSON,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallParser,
    ToolFormat,
    detect_tool_format,
)

TRICKY_ARGUMENTS = '{"query": "a } b { \\"quoted\\" ]", "nested": {"list": [1, {"x": "}"}], "empty": {}}}'
SECOND_ARGUMENTS = '{"city": "Paris, \\"la ville lumi\\u00e8re\\""}'
CALLS = [("search", TRICKY_ARGUMENTS), ("get_weather", SECOND_ARGUMENTS), ("now", "{}")]
PREAMBLE = "Let me check {that} for you <b>now</b>."


def _run(tool_format: ToolFormat, text: str, step: int) -> tuple[str, list[tuple[str, str]], list]:
    parser = ToolCallParser(tool_format)
    events = []
    for start in range(0, len(text), step):
        events += parser.feed(text[start:start + step])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStart):
            assert event.index not in calls, "a call must start once"
            assert event.index == len(calls), "calls are numbered in order"
            calls[event.index] = [event.name, ""]
        elif isinstance(event, ArgumentsDelta):
            assert event.index in calls, "arguments come after their call's start"
            calls[event.index][1] += event.text
    return content, [(name, arguments) for name, arguments in calls.values()], events


@pytest.mark.parametrize("tool_format", [HERMES, GENERIC_JSON, MISTRAL, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("step", range(1, 11))
def test_preamble_then_parallel_calls(tool_format: ToolFormat, step: int) -> None:
    text = f"{PREAMBLE}\n{tool_format.render_calls(CALLS)}"
    if tool_format.bare_json_start:  # Llama 3 writes calls after a trigger when text comes first
        text = f"{PREAMBLE} {tool_format.trigger}{tool_format.render_calls(CALLS)}"
    content, calls, _ = _run(tool_format, text, step)
    assert content == PREAMBLE
    assert calls == CALLS
    for _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize("tool_format", [HERMES, GENERIC_JSON, MISTRAL, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("step", range(1, 11))
def test_calls_only(tool_format: ToolFormat, step: int) -> None:
    content, calls, events = _run(tool_format, tool_format.render_calls(CALLS[:2]) + "\n", step)
    assert content == ""
    assert calls == CALLS[:2]
    assert not any(isinstance(e, ContentDelta) for e in events)


@pytest.mark.parametrize("step", range(1, 11))
def test_llama3_bare_json(step: int) -> None:
    text = ' {"name": "search", "parameters": ' + TRICKY_ARGUMENTS + '}; {"name": "now", "parameters": {}}'
    content, calls, _ = _run(LLAMA3_JSON, text, step)
    assert (content, calls) == ("", [("search", TRICKY_ARGUMENTS), ("now", "{}")])


@pytest.mark.parametrize("tool_format", [HERMES, MISTRAL, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("step", range(1, 11))
def test_plain_text_passes_through(tool_format: ToolFormat, step: int) -> None:
    text = 'No call: a literal {"name": "x"} object, <tool and [TOOL and <|python in text.'
    content, calls, _ = _run(tool_format, text, step)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("step", range(1, 11))
def test_arguments_stream_before_the_call_ends(step: int) -> None:
    """Fragments arrive while the call is written, not all at its end."""
    text = HERMES.render_calls([CALLS[0]])
    _, _, events = _run(HERMES, text, step)
    fragments = [e for e in events if isinstance(e, ArgumentsDelta)]
    if step < len(TRICKY_ARGUMENTS) // 2:
        assert len(fragments) > 1
    assert isinstance(events[0], CallStart)


@pytest.mark.parametrize("step", range(1, 11))
def test_name_after_arguments_and_string_arguments(step: int) -> None:
    text = ('<tool_call>\n{"arguments": {"q": "}"}, "name": "late"}\n</tool_call>\n'
            '<tool_call>\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n</tool_call>')
    content, calls, _ = _run(HERMES, text, step)
    assert (content, calls) == ("", [("late", '{"q": "}"}'), ("s", '{"q": 1}')])


@pytest.mark.parametrize("step", range(1, 11))
def test_cut_off_call_keeps_its_partial_arguments(step: int) -> None:
    content, calls, _ = _run(HERMES, 'Hi <tool_call>\n{"name": "search", "arguments": {"query": "a b  ', step)
    assert (content, calls) == ("Hi", [("search", '{"query": "a b')])


@pytest.mark.parametrize("step", range(1, 11))
def test_object_without_name_is_content(step: int) -> None:
    content, calls, _ = _run(HERMES, '<tool_call>\n{"tool": "x"}\n</tool_call> ok', step)
    assert calls == []
    assert '{"tool": "x"}' in content


def test_detect_tool_format_from_template() -> None:
    assert detect_tool_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_tool_format("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert detect_tool_format("<|start_header_id|>{% if tools %}{% endif %}") is LLAMA3_JSON
    assert detect_tool_format("<|im_start|>{{ message['content'] }}") is GENERIC_JSON
    assert detect_tool_format(None) is GENERIC_JSON
    assert detect_tool_format("{{ '[TOOL_CALLS]' }}", configured="hermes") is HERMES  # the config wins


@pytest.mark.parametrize("step", range(1, 11))
def test_cut_off_second_trigger_is_not_content(step: int) -> None:
    text = HERMES.render_calls([CALLS[2]]) + "\n<tool_"
    assert _run(HERMES, text, step)[:2] == ("", [("now", "{}")])
