"""Property-based fuzzing of the OpenAI API from its own /v1/openapi.json (schemathesis): whatever
the generated request, the server answers without a 5xx. Examples are bounded (count, and the
tokens each may ask for) so the run stays in CI budget on CPU."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

MAX_EXAMPLES = 25  # per operation
MAX_TOKENS = 4  # generated requests may ask for thousands; the server's answer to that is tested elsewhere
MAX_CHOICES = 2


@pytest.fixture(scope="session")
def openai_schema(server: str):
    return schemathesis.openapi.from_url(f"{server}/v1/openapi.json")


schema = schemathesis.pytest.from_fixture("openai_schema")


def bounded(body: object) -> object:
    """Cap what makes a request expensive (tokens, choices), keeping every other generated value."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = min(body[key], MAX_TOKENS)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
        for key in ("n", "best_of"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = min(body[key], MAX_CHOICES)
    return body


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error(case, server: str) -> None:
    case.body = bounded(case.body)
    response = case.call(base_url=f"{server}/v1", timeout=120)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
