"""The Responses API end to end: the official openai client against `bentoml serve` of the default
model (greedy, short outputs keep the CPU time small)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


def test_create_plain(openai_client, served_model) -> None:
    response = openai_client.responses.create(model=served_model, input="Say hello.", instructions="Be brief.",
                                              max_output_tokens=12, temperature=0, metadata={"k": "v"}, user="u1")
    assert response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 12
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.metadata == {"k": "v"} and response.instructions == "Be brief."
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_stream_events_in_order_with_sequence_numbers(openai_client, served_model) -> None:
    events = list(openai_client.responses.create(model=served_model, input="Count: one, two,", stream=True,
                                                 max_output_tokens=10, temperature=0))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{events[-1].response.status}"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and set(types[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    assert "".join(deltas) == final.output_text == events[-4].text
    assert final.usage.output_tokens > 0


def test_parse_with_a_pydantic_text_format(openai_client, served_model) -> None:
    response = openai_client.responses.parse(model=served_model, input="Invent a person.", text_format=Person,
                                             max_output_tokens=60, temperature=0)
    assert isinstance(response.output_parsed, Person)


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_format_with_and_without_strict(openai_client, served_model, strict: bool) -> None:
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": strict}}
    response = openai_client.responses.create(model=served_model, input="Invent a person.", text=text,
                                              max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(response.output_text), PERSON_SCHEMA)


def test_json_object_format(openai_client, served_model) -> None:
    response = openai_client.responses.create(model=served_model, input="A JSON object please.",
                                              text={"format": {"type": "json_object"}}, max_output_tokens=40,
                                              temperature=0)
    assert response.output_text.startswith("{")
    if response.status == "completed":  # a 135M model may fill the object up to max_output_tokens
        assert isinstance(json.loads(response.output_text), dict)


def _weather_call(openai_client, served_model, **extra):
    response = openai_client.responses.create(model=served_model, input="What is the weather in Paris?",
                                              tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=60,
                                              temperature=0, **extra)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["parameters"])
    return response, calls[0]


def test_function_tool_round_trip_with_previous_response_id(openai_client, served_model) -> None:
    first, call = _weather_call(openai_client, served_model)
    second = openai_client.responses.create(
        model=served_model, previous_response_id=first.id, tools=[WEATHER_TOOL], max_output_tokens=16, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert second.previous_response_id == first.id
    assert second.status in ("completed", "incomplete")
    # The earlier turn and its calls are in the prompt, exactly as if sent back by hand. (Not all of
    # the first output's tokens need be: an answer is cut where the model repeats a call.)
    by_hand = openai_client.responses.create(
        model=served_model, tools=[WEATHER_TOOL], max_output_tokens=1, temperature=0, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert second.usage.input_tokens == by_hand.usage.input_tokens > first.usage.input_tokens


def test_function_tool_round_trip_with_items_sent_back_by_hand(openai_client, served_model) -> None:
    first, call = _weather_call(openai_client, served_model, store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)  # store=False keeps nothing
    conversation = [{"role": "user", "content": "What is the weather in Paris?"},
                    *[item.model_dump(exclude_none=True) for item in first.output],
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = openai_client.responses.create(model=served_model, input=conversation, tools=[WEATHER_TOOL],
                                            max_output_tokens=16, temperature=0)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens


def test_named_tool_choice_streams_the_arguments(openai_client, served_model) -> None:
    events = list(openai_client.responses.create(
        model=served_model, input="Weather in Rome?", tools=[WEATHER_TOOL], stream=True, max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER_TOOL["parameters"])
    item = events[-1].response.output[-1]
    assert item.type == "function_call" and item.arguments == done.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_stored_responses_get_delete_cancel(openai_client, served_model) -> None:
    created = openai_client.responses.create(model=served_model, input="Hi", max_output_tokens=4, temperature=0)
    fetched = openai_client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    with pytest.raises(openai.BadRequestError, match=f"status '{created.status}'"):
        openai_client.responses.cancel(created.id)
    openai_client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as error:
        openai_client.responses.create(model=served_model, input="Hi", previous_response_id=created.id)
    assert error.value.body["param"] == "previous_response_id"


def test_hosted_tools_are_refused_by_name(openai_client, served_model) -> None:
    with pytest.raises(openai.BadRequestError, match="web_search") as error:
        openai_client.responses.create(model=served_model, input="news?", tools=[{"type": "web_search"}])
    assert error.value.body["param"] == "tools[0].type"


@pytest.mark.parametrize("request_fields, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format"),
    ({"input": "hi", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "hi", "frequency_penalty": 1.0}, "frequency_penalty"),
    ({"input": "hi", "background": True}, "background"),
])
def test_bad_requests_name_the_responses_field(server, served_model, request_fields, param) -> None:
    response = httpx.post(f"{server}/v1/responses", json={"model": served_model, **request_fields}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_refused_stream_is_a_400_before_any_event(server, served_model) -> None:
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}
    with httpx.stream("POST", f"{server}/v1/responses", timeout=60,
                      json={"model": served_model, "input": "hi", "stream": True, "text": text}) as response:
        assert response.status_code == 400
        assert response.headers["content-type"].startswith("application/json")


def test_logprobs_via_include(openai_client, served_model) -> None:
    response = openai_client.responses.create(model=served_model, input="Hi", max_output_tokens=4, temperature=0,
                                              include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) > 0 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == response.output_text


def test_cancel_stops_a_streamed_response_in_progress(openai_client, served_model) -> None:
    digits = {"type": "json_schema", "name": "digits", "schema": {  # cannot end early
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400}}
    stream = openai_client.responses.create(model=served_model, input="Digits please.", stream=True, temperature=0,
                                            max_output_tokens=3000, text={"format": digits})
    events = iter(stream)
    created = next(events)
    assert created.type == "response.created"
    cancelled = openai_client.responses.cancel(created.response.id)
    assert cancelled.status == "cancelled"
    rest = list(events)
    assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"
    assert len(rest[-1].response.output_text) < 800  # stopped long before the 400 digits
    assert openai_client.responses.retrieve(created.response.id).status == "cancelled"
