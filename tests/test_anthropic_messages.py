"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client, unchanged, against the shared server of the default model: plain and streamed
messages that agree, a tool-use round trip with the input constrained by its `input_schema`,
tool_choice, stop sequences, usage, token counts, and errors in Anthropic's shape."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "Get the current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # this client version no longer sends temperature itself


@pytest.fixture(scope="module")
def client(server: str):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def test_plain_and_streamed_agree(client, served_model) -> None:
    kwargs = dict(model=served_model, max_tokens=12, system="You are terse.",
                  messages=[{"role": "user", "content": "Name a color."}], **GREEDY)
    message = client.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant" and message.model == served_model
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert streamed.content[0].text == message.content[0].text
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (message.stop_reason, message.usage.output_tokens)


def test_tool_use_round_trip(client, served_model) -> None:
    first = client.messages.create(model=served_model, max_tokens=40, messages=QUESTION, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True}, **GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    answer = client.messages.create(
        model=served_model, max_tokens=16, tools=[WEATHER], **GREEDY,
        messages=[*QUESTION, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "Sunny, 21 degrees"}]}])
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    with client.messages.stream(model=served_model, max_tokens=40, messages=QUESTION, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    none = client.messages.create(model=served_model, max_tokens=8, messages=QUESTION, tools=[WEATHER],
                                  tool_choice={"type": "none"}, **GREEDY)
    assert [b.type for b in none.content] == ["text"]


def test_stop_sequences(client, served_model) -> None:
    message = client.messages.create(model=served_model, max_tokens=30, stop_sequences=["4."],
                                     messages=[{"role": "user", "content": "Count from 1 to 10."}], **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "4."
    assert "4." not in message.content[0].text and message.content[0].text.startswith("1.")


def test_count_tokens_is_the_prompt_messages_reads(client, served_model) -> None:
    kwargs = dict(model=served_model, messages=QUESTION, tools=[WEATHER], system="Be brief.")
    counted = client.messages.count_tokens(**kwargs).input_tokens
    assert counted == client.messages.create(max_tokens=1, **kwargs, **GREEDY).usage.input_tokens
    assert counted > client.messages.count_tokens(model=served_model, messages=QUESTION).input_tokens


@pytest.mark.parametrize("body,where", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": QUESTION, "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}, "tools[0]"),
    ({"messages": QUESTION, "extra_body": {"unknown_field": 1}}, "unknown_field"),
])
def test_errors_in_anthropic_shape(client, served_model, server, body, where) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model=served_model, **{"max_tokens": 8, **body})
    assert raised.value.status_code == 400
    error = raised.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert where in error["error"]["message"]


def test_unknown_model_and_a_broken_body(server) -> None:
    missing = httpx.post(f"{server}/v1/messages", json={"model": "nope", "max_tokens": 4, "messages": QUESTION},
                         timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    broken = httpx.post(f"{server}/v1/messages", content=b"{not json", timeout=60,
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["type"] == "error"
