"""Structured output after a thinking section, through a real server of the default model configured
with plain-string markers (`<think>` / `</think>`; SmolLM2 has none of its own, and never writes the
end marker itself, so every answer here exists only because the budget forced the marker): JSON
schemas and tool calls on chat, completions, Responses and Messages, streamed and not; the thinking
kept out of what `parse()` reads; the switches that turn the section off; the budget's bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from bento_server import BentoServer, bentoml_serve

MODEL = "smollm2-135m-instruct"
DEFAULT_BUDGET = 6
BUDGET_LIMIT = 64
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
QUESTION = [{"role": "user", "content": "What is 2+2? Answer in JSON."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                                           "required": ["city"], "additionalProperties": False}}}


class Answer(BaseModel):
    answer: int


@pytest.fixture(scope="module")
def thinking(bentoml_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BentoServer]:
    folder = tmp_path_factory.mktemp("reasoning")
    (folder / "config.json5").write_text(f"""{{
        reasoning: {{start: "<think>", end: "</think>", default_max_reasoning_tokens: {DEFAULT_BUDGET},
                     max_reasoning_tokens_limit: {BUDGET_LIMIT}}},
        runtime: {{max_batch_size: 4}},
    }}""")
    with bentoml_serve(".", bentoml_home, folder / "serve.log", {"LLGTRT_CONFIG": str(folder / "config.json5")}) as s:
        yield s


@pytest.fixture(scope="module")
def client(thinking: BentoServer):
    import openai

    return openai.OpenAI(base_url=f"{thinking.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server: BentoServer, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=120)


def _token_count(server: BentoServer, text: str) -> int:
    response = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60)
    return response.json()["count"]


def _stream_chat(client, **kwargs) -> tuple[str, str, list]:
    thinking, content, calls = "", "", {}
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        thinking += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    return thinking, content, list(calls.values())


def test_chat_json_schema_after_thinking(client, thinking) -> None:
    message = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                             response_format=JSON_FORMAT).choices[0].message
    assert message.reasoning_content  # vLLM's field, passed through by the client
    assert "<think>" not in message.reasoning_content and "</think>" not in message.content
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert _token_count(thinking, message.reasoning_content) <= DEFAULT_BUDGET
    streamed = _stream_chat(client, messages=QUESTION, max_tokens=40, response_format=JSON_FORMAT)
    assert streamed == (message.reasoning_content, message.content, [])
    parsed = client.chat.completions.parse(model=MODEL, messages=QUESTION, max_tokens=40, temperature=0,
                                           response_format=Answer).choices[0].message
    assert parsed.parsed == Answer.model_validate_json(message.content)  # parse() reads the answer only


def test_chat_tool_calls_after_thinking(client) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = client.chat.completions.create(model=MODEL, messages=question, tools=[WEATHER], tool_choice="required",
                                            max_tokens=60, temperature=0, parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    thinking_text, content, calls = _stream_chat(client, messages=question, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=60, parallel_tool_calls=False)
    assert thinking_text == choice.message.reasoning_content and not content
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_constrain_the_answer_after_the_thinking(thinking, stream) -> None:
    """Completions return the text whole, markers included (as vLLM does)."""
    body = dict(prompt="<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", max_tokens=40,
                response_format=JSON_FORMAT, max_reasoning_tokens=4, stream=stream)
    response = _post(thinking, "completions", **body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        text = response.json()["choices"][0]["text"]
    assert text.startswith("<think>")
    thought, _, answer = text.removeprefix("<think>").partition("</think>")
    assert _token_count(thinking, thought) <= 4  # then the marker was forced
    jsonschema.validate(json.loads(answer), ANSWER)


def test_the_budget_forces_the_end_marker(thinking) -> None:
    """Unconstrained, the model runs on to max_tokens; a budget of 3 ends its thinking at 3 tokens."""
    prompt = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
    free = _post(thinking, "completions", prompt=prompt, max_tokens=24, max_reasoning_tokens=0).json()
    assert "</think>" not in free["choices"][0]["text"]
    for budget in (1, 3):
        text = _post(thinking, "completions", prompt=prompt, max_tokens=24,
                     max_reasoning_tokens=budget).json()["choices"][0]["text"]
        thought, marker, _ = text.removeprefix("<think>").partition("</think>")
        assert marker and 0 < _token_count(thinking, thought) <= budget


def test_responses_reasoning_item_then_the_answer(client) -> None:
    kwargs = dict(model=MODEL, input="What is 2+2? Answer in JSON.", max_output_tokens=40, temperature=0,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}})
    response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert streamed.output_text == response.output_text
    assert streamed.output[0].content[0].text == reasoning.content[0].text
    follow_up = client.responses.create(model=MODEL, previous_response_id=response.id, input="Thanks!",
                                        max_output_tokens=4)
    sent_back = client.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"type": "reasoning", "id": reasoning.id, "summary": [], "content": [reasoning.content[0].model_dump()]},
        {"role": "user", "content": "Thanks!"}])
    assert follow_up.status == sent_back.status == "incomplete"  # accepted, and cut at 4 tokens
    calls = client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=60, temperature=0,
                                    tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required")
    assert [item.type for item in calls.output][:2] == ["reasoning", "function_call"]


@pytest.mark.parametrize("switch", [{"max_reasoning_tokens": 0}, {"reasoning_effort": "none"},
                                    {"chat_template_kwargs": {"enable_thinking": False}}])
def test_switched_off_the_answer_comes_at_once(thinking, switch) -> None:
    response = _post(thinking, "chat/completions", messages=QUESTION, max_tokens=20, response_format=JSON_FORMAT,
                     **switch)
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), ANSWER)


def test_budget_bounds_and_a_model_without_thinking(thinking, server) -> None:
    over = _post(thinking, "chat/completions", messages=QUESTION, max_tokens=8, max_reasoning_tokens=BUDGET_LIMIT + 1)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_reasoning_tokens"
    effort = _post(thinking, "chat/completions", messages=QUESTION, max_tokens=8, reasoning_effort="extreme")
    assert effort.status_code == 400 and effort.json()["error"]["param"] == "reasoning_effort"
    plain = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                       json={"messages": QUESTION, "max_tokens": 4, "max_reasoning_tokens": 8})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "max_reasoning_tokens"


def test_anthropic_thinking_blocks_and_structured_output(thinking) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=thinking.url, api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, max_tokens=40, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 5},
                  output_config={"format": {"type": "json_schema", "schema": ANSWER}}, extra_body={"temperature": 0})
    message = client.messages.create(**kwargs)
    thought, text = message.content
    assert thought.type == "thinking" and thought.thinking and _token_count(thinking, thought.thinking) <= 5
    jsonschema.validate(json.loads(text.text), ANSWER)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in message.content]
    off = client.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
