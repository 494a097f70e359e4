"""The parts of the OpenAI surface clients call besides generation: JSON errors for unknown paths,
GET /v1/models/{id}, /health and /version, the SDK's parse() round trip; and, on a server of their own,
CORS and the admission limit of /v1/responses."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from bento_server import BentoServer, bentoml_serve

ORIGIN = "https://app.example.com"
API_KEY = "parity-key"


class GetWeather(BaseModel):
    city: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


@pytest.mark.parametrize("method, path", [("GET", "/v1/nope"), ("POST", "/v1/chat/nope"), ("DELETE", "/v1/a/b/c")])
def test_unknown_paths_get_openai_json_404s(server, method, path) -> None:
    response = httpx.request(method, f"{server}{path}", timeout=10)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and path in error["message"]


def test_wrong_method_gets_a_json_405_with_allow(server) -> None:
    response = httpx.get(f"{server}/v1/chat/completions", timeout=10)
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_client_sees_the_404_message(openai_client) -> None:
    with pytest.raises(openai.NotFoundError, match="Unknown request URL"):
        openai_client.get("/nope", cast_to=object)


def test_models_retrieve(openai_client, served_model) -> None:
    assert openai_client.models.retrieve(served_model).id == served_model
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")


def test_health_and_version(server) -> None:
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server}/version", timeout=10).json()["version"]


def test_no_cors_by_default(server) -> None:
    preflight = httpx.options(f"{server}/v1/chat/completions", timeout=10,
                              headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_chat_parse_round_trip_sends_the_parsed_message_back(openai_client, served_model) -> None:
    """The SDK's parsed messages carry client-side fields (parsed, parsed_arguments, refusal,
    annotations...); appending them to the conversation must work."""
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [openai.pydantic_function_tool(GetWeather)]
    first = openai_client.chat.completions.parse(model=served_model, messages=messages, tools=tools,
                                                 tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                                 temperature=0)
    message = first.choices[0].message
    call = message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
                 {"role": "user", "content": "Now invent a person."}]
    second = openai_client.chat.completions.parse(model=served_model, messages=messages, response_format=Person,
                                                  max_tokens=60, temperature=0)
    assert isinstance(second.choices[0].message.parsed, Person)
    messages += [second.choices[0].message, {"role": "user", "content": "Thanks."}]
    openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: parsed"):
        openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=4,
                                              extra_body={"parsed": {}})  # at the top level it stays unknown


@pytest.fixture(scope="module")
def cors_server(bentoml_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BentoServer]:
    folder = tmp_path_factory.mktemp("cors")
    (folder / "config.json5").write_text(f"""{{
        server: {{api_key: "{API_KEY}", cors_allow_origins: ["{ORIGIN}"],
                  max_concurrent_requests: 1, max_queued_requests: 0}},
    }}""")
    with bentoml_serve(".", bentoml_home, folder / "serve.log", {"LLGTRT_CONFIG": str(folder / "config.json5")}) as s:
        yield s


def test_cors_preflight_needs_no_key_and_names_the_origin(cors_server: BentoServer) -> None:
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.options(f"{cors_server.url}/v1/responses", headers=headers, timeout=10)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{cors_server.url}/v1/responses", headers={**headers, "Origin": "https://evil.example"},
                          timeout=10)
    assert "access-control-allow-origin" not in other.headers
    models = httpx.get(f"{cors_server.url}/v1/models", timeout=10,
                       headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ORIGIN


def test_responses_are_admitted_like_completions(cors_server: BentoServer) -> None:
    """One place, no queue: while a streamed response holds the place, another gets 429."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    # A schema the model cannot end early: the generation holds its place for many seconds.
    digits = {"type": "json_schema", "name": "digits", "schema": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400}}
    body = {"input": "Digits please.", "max_output_tokens": 3000, "temperature": 0, "text": {"format": digits}}
    started, release = threading.Event(), threading.Event()

    def hold_the_place() -> None:
        with httpx.stream("POST", f"{cors_server.url}/v1/responses", json={**body, "stream": True}, headers=auth,
                          timeout=120) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            started.set()
            release.wait(60)

    holder = threading.Thread(target=hold_the_place)
    holder.start()
    try:
        assert started.wait(120)
        refused = httpx.post(f"{cors_server.url}/v1/responses", json=body, headers=auth, timeout=30)
        assert refused.status_code == 429 and "retry-after" in refused.headers
    finally:
        release.set()
        holder.join()
