"""Tool calling end to end: the official openai client against `bentoml serve` of the default model.

SmolLM2's template (ChatML) knows no tools, so these run through the generic JSON format; the
grammar makes even a 135M model's `required` and named calls valid. Greedy, short outputs keep
the CPU time small.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                       "required": ["timezone"], "additionalProperties": False},
        "strict": True,
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
MARKUP = ("<tool_call>", "</tool_call>", '"arguments"')


def _create(client, model, max_tokens: int = 60, **kwargs):
    return client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens, **kwargs)


def _assert_valid_calls(tool_calls) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _stream_chunks(client, model, **kwargs) -> list:
    return list(_create(client, model, stream=True, **kwargs))


def _accumulate(chunks, tools=openai.omit):
    """The client's own stream accumulator: its snapshot of the whole completion."""
    state = ChatCompletionStreamState(input_tools=tools)
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def _assert_stream_shape(chunks) -> None:
    """id/type/name once, in the first delta of each index; no markup in content."""
    seen: set[int] = set()
    for chunk in chunks:
        for choice in chunk.choices:
            assert not any(m in (choice.delta.content or "") for m in MARKUP)
            for call in choice.delta.tool_calls or []:
                first = call.index not in seen
                assert (call.id is not None) == first and (call.type is not None) == first
                assert (call.function.name is not None) == first
                assert isinstance(call.function.arguments, str)
                seen.add(call.index)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] is not None


def test_required_single_call_validates_and_streams_the_same(openai_client, served_model) -> None:
    args = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = _create(openai_client, served_model, **args)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _assert_valid_calls(choice.message.tool_calls)

    chunks = _stream_chunks(openai_client, served_model, **args)
    _assert_stream_shape(chunks)
    streamed = _accumulate(chunks, TOOLS).choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_required_parallel_calls_all_validate(openai_client, served_model) -> None:
    response = _create(openai_client, served_model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                       max_tokens=90)
    choice = response.choices[0]
    calls = choice.message.tool_calls
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # "length" may cut the last one
    assert choice.finish_reason in ("tool_calls", "length")
    _assert_valid_calls(complete)
    assert not any(m in (choice.message.content or "") for m in MARKUP)


def test_named_choice_calls_that_tool_and_stops(openai_client, served_model) -> None:
    args = dict(messages=QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = _create(openai_client, served_model, **args)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    _assert_valid_calls(choice.message.tool_calls)

    chunks = _stream_chunks(openai_client, served_model, **args)
    _assert_stream_shape(chunks)
    streamed = _accumulate(chunks, TOOLS).choices[0]
    assert streamed.finish_reason == "stop"
    assert streamed.message.tool_calls[0].function.arguments == choice.message.tool_calls[0].function.arguments


def test_follow_up_turn_with_tool_results_answers_in_text(openai_client, served_model) -> None:
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    response = _create(openai_client, served_model, messages=messages, tools=TOOLS, tool_choice="none",
                       max_tokens=24)
    message = response.choices[0].message
    assert message.tool_calls is None
    assert message.content and not any(m in message.content for m in MARKUP)


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    sky: Literal["sunny", "cloudy", "rainy"]
    temperature_c: int


def test_tools_with_response_format_constrain_the_answer(openai_client, served_model) -> None:
    """auto + response_format: the model answers either a call or JSON matching the format."""
    messages = [{"role": "user", "content": "It is 21 degrees and sunny in Paris. Give the forecast as JSON."}]
    schema = {**Forecast.model_json_schema(), "additionalProperties": False}
    response = _create(openai_client, served_model, messages=messages, tools=TOOLS, max_tokens=40,
                       response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema}})
    choice = response.choices[0]
    if choice.message.tool_calls:
        _assert_valid_calls(choice.message.tool_calls)
    else:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_parse_with_pydantic_response_format(openai_client, served_model) -> None:
    completion = openai_client.beta.chat.completions.parse(
        model=served_model, temperature=0, max_tokens=40, response_format=Forecast,
        messages=[{"role": "user", "content": "It is 21 degrees and sunny in Paris. Give the forecast."}])
    assert isinstance(completion.choices[0].message.parsed, Forecast)


class GetWeather(BaseModel):
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def test_parse_with_pydantic_function_tool(openai_client, served_model) -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    completion = openai_client.beta.chat.completions.parse(
        model=served_model, temperature=0, max_tokens=40, messages=QUESTION, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_legacy_functions(openai_client, served_model) -> None:
    response = _create(openai_client, served_model, messages=QUESTION, functions=[WEATHER["function"]],
                       function_call={"name": "get_weather"}, max_tokens=40)
    message = response.choices[0].message
    assert message.tool_calls is None
    assert message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(message.function_call.arguments), SCHEMAS["get_weather"])


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    # Calls are forced and the answer's format does not apply, but its fields are still read.
    (dict(tools=TOOLS, tool_choice="required", extra_body={"guided_regex": "a+", "guided_choice": ["x"]}),
     "guided_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
])
def test_bad_tool_requests_are_400(openai_client, served_model, kwargs, param) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _create(openai_client, served_model, messages=QUESTION, **kwargs)
    assert caught.value.body["param"] == param


def test_tokenize_and_detokenize(server, served_model) -> None:
    chat = {"model": served_model, "messages": QUESTION}
    with_prompt = httpx.post(f"{server}/v1/tokenize", json=chat).json()
    without_prompt = httpx.post(f"{server}/v1/tokenize", json={**chat, "add_generation_prompt": False}).json()
    assert with_prompt["count"] == len(with_prompt["tokens"]) > without_prompt["count"]
    assert with_prompt["max_model_len"] > with_prompt["count"]
    with_tools = httpx.post(f"{server}/v1/tokenize", json={**chat, "tools": TOOLS}).json()
    assert with_tools["count"] > with_prompt["count"]  # the tools are described in the system message
    text = httpx.post(f"{server}/v1/detokenize", json={"model": served_model, "tokens": with_tools["tokens"]}).json()
    assert "get_weather" in text["prompt"] and text["prompt"].endswith("<|im_start|>assistant\n")
    plain = httpx.post(f"{server}/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert httpx.post(f"{server}/v1/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.post(f"{server}/v1/detokenize", json={"tokens": [-1]}).status_code == 400


def test_continue_final_message(openai_client, served_model) -> None:
    messages = QUESTION + [{"role": "assistant", "content": "The weather in Paris is"}]
    response = _create(openai_client, served_model, messages=messages, max_tokens=8,
                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert response.choices[0].message.content


def test_auto_streams_what_it_answers(openai_client, served_model) -> None:
    """auto: text or calls, and the stream accumulates to the same message either way."""
    args = dict(messages=QUESTION, tools=TOOLS, max_tokens=16)
    choice = _create(openai_client, served_model, **args).choices[0]
    chunks = _stream_chunks(openai_client, served_model, **args)
    _assert_stream_shape(chunks)
    streamed = _accumulate(chunks).choices[0]
    assert streamed.message.content == choice.message.content
    assert streamed.finish_reason == choice.finish_reason
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert choice.finish_reason in ("stop", "length")
