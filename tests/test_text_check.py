"""lone_surrogate_param on raw request bodies: every spelling of a lone surrogate escape is found, and a
pair or an escaped backslash is not (its fast pre-scan must not let one through)."""

from __future__ import annotations

import json

import pytest

from llgtrt_core.api.text_check import lone_surrogate_param


@pytest.mark.parametrize("body, param", [
    (b'{"a": "\\ud800"}', "a"),
    (b'{"a": "\\uD8FF x"}', "a"),  # upper-case hex
    (b'{"m": [{"c": "ok"}, {"c": "\\udc00"}]}', "m[1].c"),  # a low one alone
    (b'{"a": "\\uDFFF"}', "a"),
])
def test_a_lone_surrogate_escape_is_named(body: bytes, param: str) -> None:
    assert lone_surrogate_param(body) == param


@pytest.mark.parametrize("body", [
    b'{"a": "\\ud83d\\ude00"}',  # a pair: one emoji
    b'{"a": "\\\\ud800"}',  # an escaped backslash, then plain text
    json.dumps({"a": "h\u00e9llo \u65e5\u672c \U0001F600"}).encode(),  # what json.dumps writes for non-ASCII text
    b'{"a": "\\u00e9\\ucafe"}',  # escapes outside the surrogate range
])
def test_text_without_a_lone_surrogate_passes(body: bytes) -> None:
    assert lone_surrogate_param(body) is None
