"""Default bounds on JSON-schema numbers: digits end, a schema's own bounds win, a request can
turn them off."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher, LLTokenizer

from llgtrt_core.constraints.request_grammar import NumberBounds, grammar_for_request

BYTES = LLTokenizer("byte")


def accepts(schema: dict, text: str, **request) -> bool:
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}, **request}
    matcher = LLMatcher(BYTES, grammar_for_request(body, number_bounds=NumberBounds()))
    assert not matcher.is_error()
    return matcher.consume_tokens(BYTES.tokenize_str(text)) and matcher.is_accepting()


INTEGER = {"type": "object", "properties": {"n": {"type": "integer"}}}
NUMBER = {"type": "object", "properties": {"x": {"type": "number"}}}


@pytest.mark.parametrize("schema,text,bounded,unbounded", [
    (INTEGER, '{"n":1000000000000000000}', True, True),  # 10**18
    (INTEGER, '{"n":-1000000000000000000}', True, True),
    (INTEGER, '{"n":1000000000000000001}', False, True),
    (INTEGER, '{"n":' + "1" * 40 + "}", False, True),
    (NUMBER, '{"x":3.141592653}', True, True),
    (NUMBER, '{"x":3.1415926535}', False, True),  # a tenth fraction digit
    (NUMBER, '{"x":1e5}', False, True),
    (NUMBER, '{"x":-2.5}', True, True),
])
def test_numbers_are_bounded_by_default_and_a_request_can_opt_out(schema, text, bounded, unbounded):
    assert accepts(schema, text) is bounded
    assert accepts(schema, text, bounded_numbers=False) is unbounded


def test_the_schemas_own_bounds_win():
    schema = {"type": "object", "properties": {
        "small": {"type": "integer", "minimum": -5, "maximum": 5},
        "big": {"type": "integer", "minimum": 0},
        "fine": {"type": "number", "multipleOf": 0.5}}}
    assert accepts(schema, '{"small":-5}') and not accepts(schema, '{"small":6}')
    assert not accepts(schema, '{"big":-1}')  # its minimum kept, the default maximum added
    assert accepts(schema, '{"big":1000000000000000000}') and not accepts(schema, '{"big":1000000000000000001}')
    assert accepts(schema, '{"fine":1e3}') is False  # the default maximum still excludes exponents
    assert accepts(schema, '{"fine":2.5}')
