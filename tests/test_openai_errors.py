"""Bad requests get OpenAI error bodies with 400 (404 for an unknown model), never a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

CHAT = [{"role": "user", "content": "Hi"}]


def _post(server: str, path: str, body) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(f"{server}/v1{path}", timeout=60, headers={"content-type": "application/json"}, **kwargs)


def _assert_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    return error


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": CHAT, "max_tokens": -1}, "max_tokens"),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "n": "two"}, "n"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT, "temperature": 5}, "temperature"),
    ({"messages": CHAT, "top_p": 0}, "top_p"),
    ({"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": CHAT, "logprobs": "maybe"}, "logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": CHAT, "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"messages": CHAT, "logit_bias": {"1": 101}}, "logit_bias"),
    ({"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": CHAT, "no_such_field": 1}, "no_such_field"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
])
def test_bad_chat_requests(server, served_model, body, param) -> None:
    _assert_error(_post(server, "/chat/completions", {"model": served_model, **body}), 400, param)


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10, 10**9]}, "prompt"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
])
def test_bad_completion_requests(server, served_model, body, param) -> None:
    _assert_error(_post(server, "/completions", {"model": served_model, **body}), 400, param)


def test_invalid_json(server) -> None:
    _assert_error(_post(server, "/chat/completions", "{not json"), 400, None)


def test_unknown_model_is_404(server, openai_client) -> None:
    error = _assert_error(_post(server, "/chat/completions", {"model": "gpt-17", "messages": CHAT}), 404, "model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.chat.completions.create(model="gpt-17", messages=CHAT)
    assert raised.value.body["code"] == "model_not_found"


def test_prompt_longer_than_context(server, openai_client, served_model) -> None:
    max_model_len = httpx.get(f"{server}/v1/models").json()["data"][0]["max_model_len"]
    long_text = "hello " * (max_model_len + 10)
    error = _assert_error(_post(server, "/chat/completions", {"model": served_model, "messages": [
        {"role": "user", "content": long_text}]}), 400, "messages")
    assert error["code"] == "context_length_exceeded"
    _assert_error(_post(server, "/completions", {"model": served_model, "prompt": long_text}), 400, "prompt")
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=max_model_len)


def test_openai_client_sees_bad_request(openai_client, served_model) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=-1)
    assert raised.value.body["param"] == "max_tokens"


def test_no_500_on_garbage(server) -> None:
    garbage = [None, 1, "x", [], [1], {"messages": None}, {"messages": [None]}, {"messages": [{}]},
               {"messages": [{"role": "user"}]}, {"messages": CHAT, "stop": 3}, {"messages": CHAT, "seed": 2**70},
               {"messages": CHAT, "response_format": {"type": "xml"}}, {"messages": CHAT, "n": 10**9},
               {"messages": CHAT, "stop_token_ids": [-1]}, {"messages": CHAT, "chat_template_kwargs": 3}]
    for body in garbage:
        for path in ("/chat/completions", "/completions"):
            response = _post(server, path, body)
            assert 400 <= response.status_code < 500, (body, response.text)
            assert "error" in response.json()


def test_nulls_mean_defaults(server, served_model) -> None:
    body = {"model": served_model, "messages": CHAT, "max_tokens": 3, "n": None, "stream": None,
            "temperature": None, "stop": None, "seed": None}
    response = _post(server, "/chat/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
