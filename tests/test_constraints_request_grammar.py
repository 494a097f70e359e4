"""Request fields -> one llguidance grammar: every form, conflicts, the JSON whitespace policy.

Grammars are checked by behaviour: compiled for a byte-level tokenizer, they must accept and
refuse given texts.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import llguidance
import pytest

from llgtrt_core.api.protocol import ChatCompletionRequest, CompletionRequest
from llgtrt_core.constraints import GrammarRequestError, grammar_for_request, request_grammar
from llgtrt_core.constraints.request_grammar import JsonPolicy, close_objects, dumps_compact, json_schema_grammar

BYTES = llguidance.LLTokenizer("byte")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def request(**fields: Any) -> SimpleNamespace:
    names = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "guided_whitespace_pattern")
    return SimpleNamespace(**{name: None for name in names} | fields)


@pytest.mark.parametrize(
    "fields",
    [{}, {"response_format": {"type": "text"}}, {"structured_outputs": {"whitespace_pattern": "[ ]?"}}],
)
def test_unconstrained_requests_have_no_grammar(fields):
    assert grammar_for_request(request(**fields)) is None


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema_is_enforced_whatever_strict_says(strict):
    found = request_grammar(request(response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": strict}}))
    assert found.param == "response_format.json_schema"
    assert accepts(found.grammar, '{"name":"Ada","age":36}')
    assert not accepts(found.grammar, '{"name":"Ada"}')
    assert not accepts(found.grammar, '{"name":"Ada","age":"36"}')


def test_json_object_means_any_object():
    grammar = grammar_for_request(request(response_format={"type": "json_object"}))
    assert accepts(grammar, '{"anything":[1,{"b":null}]}')
    assert not accepts(grammar, "[1]")
    assert not accepts(grammar, "plain text")


def test_llgtrt_lark_and_llguidance_forms():
    lark = request_grammar(request(response_format={"type": "lark_grammar", "lark_grammar": 'start: "yes" | "no"'}))
    assert lark.param == "response_format.lark_grammar"
    assert accepts(lark.grammar, "yes") and not accepts(lark.grammar, "maybe")
    raw = json.dumps({"grammars": [{"lark_grammar": 'start: /[0-9]{3}/'}]})
    ll = request_grammar(request(response_format={"type": "llguidance", "grammar": raw}))
    assert ll.param == "response_format.grammar"
    assert accepts(ll.grammar, "123") and not accepts(ll.grammar, "12")


@pytest.mark.parametrize("kind", ["lark_grammar", "llguidance", "json_schema"])
def test_response_format_missing_its_payload_is_a_request_error(kind):
    with pytest.raises(GrammarRequestError) as error:
        grammar_for_request(request(response_format={"type": kind}))
    assert error.value.param.startswith("response_format.")


def test_structured_outputs_forms():
    regex = grammar_for_request(request(structured_outputs={"regex": r"\d{2}-[a-z]+"}))
    assert accepts(regex, "42-abc") and not accepts(regex, "4-abc")
    choice = grammar_for_request(request(structured_outputs={"choice": ["red", "gre\"en", "blü"]}))
    assert all(accepts(choice, c) for c in ["red", 'gre"en', "blü"]) and not accepts(choice, "blue")
    lark = grammar_for_request(request(structured_outputs={"grammar": 'start: "a"+'}))
    assert accepts(lark, "aaa") and not accepts(lark, "b")
    gbnf = grammar_for_request(request(structured_outputs={"grammar": 'root ::= "x" [0-9]'}))
    assert accepts(gbnf, "x7") and not accepts(gbnf, "x")
    json_text = grammar_for_request(request(structured_outputs={"json": json.dumps(PERSON)}))
    assert accepts(json_text, '{"name":"A","age":1}') and not accepts(json_text, '{"age":1}')
    json_object = grammar_for_request(request(structured_outputs={"json_object": True}))
    assert accepts(json_object, "{}") and not accepts(json_object, "1")


def test_guided_forms():
    assert accepts(grammar_for_request(request(guided_json=PERSON)), '{"name":"A","age":1}')
    assert accepts(grammar_for_request(request(guided_json=json.dumps(PERSON))), '{"name":"A","age":1}')
    assert accepts(grammar_for_request(request(guided_regex="a|b")), "b")
    assert accepts(grammar_for_request(request(guided_choice=["x", "y"])), "y")
    assert accepts(grammar_for_request(request(guided_grammar='start: "q"')), "q")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"json_object": True}},
         "structured_outputs.json_object"),
        ({"guided_json": {}, "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_two_constraint_forms_conflict(fields, param):
    with pytest.raises(GrammarRequestError, match="only one constraint") as error:
        grammar_for_request(request(**fields))
    assert error.value.param == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"json_object": True, "whitespace_pattern": " ", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace"),
        ({"guided_json": {}, "structured_outputs": {"whitespace_pattern": " "}, "guided_whitespace_pattern": " "},
         "guided_whitespace_pattern"),
    ],
)
def test_malformed_constraints_are_request_errors(fields, param):
    with pytest.raises(GrammarRequestError) as error:
        grammar_for_request(request(**fields))
    assert error.value.param == param and error.value.message


def test_json_default_is_compact_so_whitespace_cannot_pad():
    grammar = grammar_for_request(request(guided_json=PERSON))
    value = {"name": "A b", "age": 3}
    assert accepts(grammar, dumps_compact(value))
    assert not accepts(grammar, json.dumps(value))  # ", " and ": "
    assert not accepts(grammar, '{"name":"A b","age":3}\n')
    assert not accepts(grammar, '{\n"name":"A b","age":3}')


def test_whitespace_pattern_bounds_each_gap_and_is_overridable():
    grammar = grammar_for_request(request(guided_json=PERSON, guided_whitespace_pattern="[ ]?"))
    assert accepts(grammar, '{"name": "A", "age": 3}')
    assert accepts(grammar, '{"name":"A","age":3}')
    assert not accepts(grammar, '{"name":  "A","age":3}')
    so = grammar_for_request(request(structured_outputs={"json": PERSON, "whitespace_pattern": r"\n {0,2}"}))
    assert accepts(so, '{\n  "name":"A",\n  "age":3\n}')


def test_the_server_default_can_allow_whitespace_and_requests_still_override_it():
    flexible = grammar_for_request(request(guided_json=PERSON), whitespace_flexible=True)
    assert accepts(flexible, '{ "name" : "A" , "age" : 3 }')
    strict = grammar_for_request(request(structured_outputs={"json": PERSON, "disable_any_whitespace": True}),
                                 whitespace_flexible=True)
    assert not accepts(strict, '{ "name" : "A" , "age" : 3 }')
    assert accepts(strict, '{"name":"A","age":3}')


def test_disable_any_whitespace_beats_the_schemas_own_options():
    schema = dict(PERSON, **{"x-guidance": {"whitespace_flexible": True}})
    flexible = grammar_for_request(request(guided_json=schema))
    assert accepts(flexible, '{ "name" : "A" , "age" : 3 }')  # the schema asked for it
    strict = grammar_for_request(request(structured_outputs={"json": schema, "disable_any_whitespace": True}))
    assert not accepts(strict, '{ "name" : "A" , "age" : 3 }')
    assert accepts(strict, '{"name":"A","age":3}')


@pytest.mark.parametrize("policy", [
    JsonPolicy(), JsonPolicy(whitespace_flexible=True), JsonPolicy(whitespace_pattern=r"[ ]?"),
    JsonPolicy(whitespace_flexible=True, disable_any_whitespace=True),
])
@pytest.mark.parametrize("own", [None, {"whitespace_flexible": True, "item_separator": ", "}, "not options"])
def test_the_schema_text_is_what_llguidance_would_write(policy, own):
    """The options merge as `grammar_from_json_schema` merges them (written here, not by it)."""
    schema = dict(PERSON) if own is None else dict(PERSON, **{"x-guidance": own})
    ours = json.loads(json_schema_grammar(schema, policy))["grammars"]
    theirs = json.loads(llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": policy.whitespace_flexible}, overrides=policy.overrides()))["grammars"]
    assert len(ours) == len(theirs) == 1 and ours[0]["json_schema"] == theirs[0]["json_schema"]
    assert json_schema_grammar(json.dumps(schema), policy) == json_schema_grammar(schema, policy)  # text alike


def test_a_schema_that_is_no_json_is_a_grammar_error():
    with pytest.raises(GrammarRequestError, match="not valid JSON"):
        json_schema_grammar({"type": "number", "maximum": float("nan")}, param="guided_json")
    with pytest.raises(GrammarRequestError, match="not valid JSON"):
        json_schema_grammar('{"type": "number", "maximum": Infinity}', param="guided_json")
    deep: dict = {}
    for _ in range(100_000):
        deep = {"items": deep}
    with pytest.raises(GrammarRequestError, match="nests too deeply"):
        json_schema_grammar(deep, param="guided_json")


def test_disable_additional_properties_closes_every_object():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    open_grammar = grammar_for_request(request(guided_json=schema))
    assert accepts(open_grammar, '{"a":{"b":1},"extra":2}')
    closed = grammar_for_request(request(structured_outputs={"json": schema, "disable_additional_properties": True}))
    assert accepts(closed, '{"a":{"b":1}}')
    assert not accepts(closed, '{"a":{"b":1},"extra":2}')
    assert not accepts(closed, '{"a":{"b":1,"c":2}}')


def test_close_objects_leaves_explicit_choices_and_property_names_alone():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "additionalProperties": True}},
        "$defs": {"d": {"type": "object"}},
        "anyOf": [{"properties": {"x": {}}}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["properties"]  # a property name, not a schema
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is not modified


def test_real_protocol_models_are_read():
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": False}},
    })
    found = request_grammar(chat)
    assert found.param == "response_format.json_schema"
    assert accepts(found.grammar, '{"name":"A","age":3}')
    completion = CompletionRequest.model_validate({
        "model": "m", "prompt": "x",
        "structured_outputs": {"json": PERSON, "disable_additional_properties": True, "whitespace_pattern": "[ ]?"},
    })
    grammar = grammar_for_request(completion)
    assert accepts(grammar, '{"name": "A", "age": 3}') and not accepts(grammar, '{"name":"A","age":3,"x":1}')
    guided = CompletionRequest.model_validate({"model": "m", "prompt": "x", "guided_choice": ["up", "down"]})
    assert accepts(grammar_for_request(guided), "down")
