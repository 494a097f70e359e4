"""RepeatedCallStop: a choice ends where the model repeats a tool call it already made."""

from __future__ import annotations

import pytest

from llgtrt_core.tools import HERMES, LLAMA3_JSON, ToolCallParser
from llgtrt_core.tools.repeats import RepeatedCallStop

CALL = ("get_weather", '{"city": "Paris"}')
OTHER = ("get_weather", '{"city": "Rome"}')


def run(fmt, text: str, piece: int) -> tuple[str, bool]:
    stop = RepeatedCallStop(fmt)
    out = "".join(stop.feed(text[i:i + piece]) for i in range(0, len(text), piece))
    return out + stop.flush(), stop.stopped


def calls(fmt, text: str) -> int:
    parser = ToolCallParser(fmt)
    parser.feed(text)
    parser.finish()
    return parser.num_calls


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_a_repeated_call_ends_the_text_after_the_calls_made(fmt, piece):
    text = fmt.render_calls([CALL, OTHER, CALL, CALL])
    out, stopped = run(fmt, text, piece)
    assert stopped
    assert calls(fmt, out) == 2 and text.startswith(out) and out.endswith('"Rome"}}')


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_distinct_calls_and_plain_text_pass_unchanged(fmt):
    text = fmt.render_calls([CALL, OTHER])
    assert run(fmt, text, 5) == (text, False)
    assert run(fmt, "just an answer, {no call}", 3) == ("just an answer, {no call}", False)
