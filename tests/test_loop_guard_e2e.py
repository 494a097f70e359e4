"""Through the served default model: answers that used to loop to max_tokens now end, valid;
DRY's parameters are checked and change the output."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from test_openai_tools import QUESTION, TOOLS

POPULATION = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"],
              "additionalProperties": False}


def chat(server: str, **body) -> dict:
    response = httpx.post(f"{server}/v1/chat/completions", json={"temperature": 0, "max_tokens": 120, **body},
                          timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("fields", [{}, {"bounded_numbers": False}, {"loop_guard": False}])
def test_an_integer_that_looped_now_ends_valid(server, fields) -> None:
    """At temperature 0 this request writes 1111... to max_tokens with neither the loop guard nor
    the number bounds; either one alone ends it."""
    body = dict(messages=[{"role": "user", "content": "How many people live in Tokyo?"}],
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": POPULATION}})
    looping = chat(server, **body, loop_guard=False, bounded_numbers=False)["choices"][0]
    assert looping["finish_reason"] == "length"
    choice = chat(server, **body, **fields)["choices"][0]
    assert choice["finish_reason"] == "stop"
    answer = json.loads(choice["message"]["content"])
    jsonschema.validate(answer, POPULATION)
    if fields.get("bounded_numbers", True):  # the default bound: at most 10**18, inside int64
        assert abs(answer["population"]) <= 10**18


NUMBERS = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
           "required": ["numbers"], "additionalProperties": False}


def test_an_array_of_ever_new_items_closes_before_max_tokens(server) -> None:
    """1, 2, 3, ... repeats no period: only the loop guard's length limit ends it, the same answer
    until the tokens left get short."""
    body = dict(messages=[{"role": "user", "content": "List every integer from 1 to 1000."}], max_tokens=60,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": NUMBERS}})
    unguarded = chat(server, **body, loop_guard=False)
    assert unguarded["choices"][0]["finish_reason"] == "length"
    guarded = chat(server, **body)
    choice = guarded["choices"][0]
    assert choice["finish_reason"] == "stop" and guarded["usage"]["completion_tokens"] <= 60
    jsonschema.validate(json.loads(choice["message"]["content"]), NUMBERS)
    assert unguarded["choices"][0]["message"]["content"].startswith(choice["message"]["content"][:30])


def test_required_tool_calls_end_when_a_call_repeats(server) -> None:
    body = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=200)
    repeating = chat(server, **body, stop_repeated_tool_calls=False, loop_guard=False)["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in repeating["message"]["tool_calls"]]
    assert repeating["finish_reason"] == "length" and len(set(calls[:-1])) < len(calls[:-1])
    choice = chat(server, **body)["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert choice["finish_reason"] == "tool_calls" and calls and len(set(calls)) == len(calls)


@pytest.mark.parametrize("field,value", [("dry_multiplier", -0.5), ("dry_base", 0.9), ("dry_allowed_length", 0),
                                         ("dry_penalty_last_n", -2), ("dry_sequence_breakers", [""]),
                                         ("dry_sequence_breakers", "\n")])
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_bad_dry_parameters_are_400s_naming_them(server, endpoint, field, value) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat/completions" else {"prompt": "hi"}
    response = httpx.post(f"{server}/v1/{endpoint}", json={**body, "max_tokens": 2, field: value}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_dry_stops_a_repetition_the_model_would_continue(server) -> None:
    """Greedy, the model continues the pattern; with DRY the token that would repeat it for the
    fifth time is penalized out (no breaker in the text, so the whole repeat counts)."""
    body = {"prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "temperature": 0, "max_tokens": 3,
            "logprobs": 1, "logprobs_mode": "processed_logprobs"}
    plain = httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert plain["text"].startswith(" 3")
    dry = httpx.post(f"{server}/v1/completions", json={**body, "dry_multiplier": 0.8, "dry_sequence_breakers": []},
                     timeout=120).json()["choices"][0]
    assert not dry["text"].startswith(" 3")
    # Breakers that cut every match leave the output as it was.
    broken = httpx.post(f"{server}/v1/completions", json={**body, "dry_multiplier": 0.8,
                                                           "dry_sequence_breakers": [","]}, timeout=120).json()
    assert broken["choices"][0]["text"] == plain["text"]
