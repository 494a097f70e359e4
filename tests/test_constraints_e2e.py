"""Structured outputs end to end against a real `bentoml serve` of the default model.

Every output that ends with finish_reason "stop" must validate against its schema with a
JSON-schema validator (MaskBench sample + hand-written schemas); a schema llguidance cannot
compile is a 400 naming the parameter, never a 500; the other forms (choice, regex) hold.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import openai
import pytest

from llgtrt_core.constraints.request_grammar import json_schema_grammar

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "maskbench"
MAX_TOKENS = 160

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
TRIAGE = {
    "type": "object",
    "properties": {
        "severity": {"enum": ["low", "medium", "high"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "maxItems": 3},
        "urgent": {"type": "boolean"},
    },
    "required": ["severity", "urgent"],
}


def maskbench_sample(count: int = 6) -> list[tuple[str, dict[str, Any]]]:
    """Small schemas that llguidance compiles, spread over the sorted folder."""
    if not DATA.is_dir():
        return []
    tokenizer = llguidance.LLTokenizer("byte")
    picked = []
    for path in sorted(DATA.glob("*.json")):
        data = json.loads(path.read_text())
        schema = data["schema"]
        if data["meta"].get("stripped_size", 10**9) > 800:
            continue
        if llguidance.LLMatcher.validate_grammar(json_schema_grammar(schema), tokenizer):
            continue
        picked.append((path.stem, schema))
    return picked[:: max(1, len(picked) // count)][:count]


SCHEMAS = [("city", CITY), ("triage", TRIAGE)] + maskbench_sample()


def ask_json(client: openai.OpenAI, model: str, schema: dict[str, Any], strict: bool = True):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Answer in JSON that follows the schema:\n" + json.dumps(schema)[:1500]}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}},
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=1,
    ).choices[0]


def test_every_stopped_json_schema_output_validates(openai_client, served_model):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        choices = list(pool.map(lambda item: ask_json(openai_client, served_model, item[1]), SCHEMAS))
    stopped = 0
    for (name, schema), choice in zip(SCHEMAS, choices):
        assert choice.finish_reason in ("stop", "length"), name
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert stopped >= 2, "the hand-written schemas bound every string, so they must finish"


def test_strict_false_is_still_enforced(openai_client, served_model):
    choice = ask_json(openai_client, served_model, CITY, strict=False)
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), CITY)


def test_running_out_of_tokens_is_length_never_stop(openai_client, served_model):
    choice = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "A city as JSON"}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}, max_tokens=4,
    ).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith("{")


def test_streamed_json_schema_output_validates(openai_client, served_model):
    stream = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Triage: the server is down"}],
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": TRIAGE}},
        max_tokens=MAX_TOKENS, temperature=0, stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), TRIAGE)


@pytest.mark.parametrize(
    "response_format, fragment",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "nope"}}},
         "Unknown format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}},
         "Unimplemented keys"),
        ({"type": "lark_grammar", "lark_grammar": "start: missing_rule"}, "missing_rule"),
    ],
)
def test_uncompilable_constraints_are_400_naming_the_param(openai_client, served_model, response_format, fragment):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": "hi"}],
            response_format=response_format, max_tokens=8,
        )
    body = error.value.body
    assert error.value.status_code == 400
    assert fragment in body["message"]
    assert body["param"].startswith("response_format")


def test_guided_choice_and_structured_regex_on_completions(openai_client, served_model):
    choice = openai_client.completions.create(
        model=served_model, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    ).choices[0]
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    choice = openai_client.completions.create(
        model=served_model, prompt="A date:", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    ).choices[0]
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", choice.text) and choice.finish_reason == "stop"


def test_two_constraint_forms_are_a_400(openai_client, served_model):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"},
        )
    assert error.value.body["param"] == "guided_regex"
