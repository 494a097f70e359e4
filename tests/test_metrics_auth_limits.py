"""API key, request limits, the sandboxed configured chat template and the Prometheus metrics,
against a real `bentoml serve` configured by a JSON5 file (LLGTRT_CONFIG)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from bento_server import BentoServer, bentoml_serve
from llgtrt_core.metrics import DeferredHistogram, observe_many

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUEST_BYTES = 16384
MAX_MODEL_LEN = 256
RETRY_AFTER_S = 2
# A template trying to reach Python's internals from the sandbox (classic template injection).
def test_prefix_cache_counters_follow_the_cached_tokens(prod: BentoServer) -> None:
    """The same 50-odd-token prompt twice: both lookups count every prompt token, and the second one's
    hits are the cached tokens its usage reports."""
    body = completion("Once upon a time, in a village by the sea, there lived an old fisherman who told "
                      "stories to the children every evening at sunset, about storms, whales, lost ships "
                      "and the lighthouse keeper who never slept,", max_tokens=1)
    before = _samples(prod)
    usages = [httpx.post(f"{prod.url}/v1/completions", json=body, headers=AUTH, timeout=60).json()["usage"]
              for _ in range(2)]
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (usages[1]["prompt_tokens"] - 1) // 16 * 16 >= 32
    after = _samples_once_grown(prod, before, {"llgtrt:prefix_cache_queries_total": 2 * usages[0]["prompt_tokens"]})
    assert after["llgtrt:prefix_cache_queries_total"] - before.get("llgtrt:prefix_cache_queries_total", 0) == (
        2 * usages[0]["prompt_tokens"])
    hits = after["llgtrt:prefix_cache_hits_total"] - before.get("llgtrt:prefix_cache_hits_total", 0)
    assert hits == usages[0]["prompt_tokens_details"]["cached_tokens"] + cached
    assert after["llgtrt:prefix_cache_blocks"] >= cached // 16


HOSTILE_TEMPLATE = "{{ cycler.__init__.__globals__.os.popen('id').read() }}{{ messages[0].content }}"


@pytest.fixture(scope="module")
def prod(bentoml_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BentoServer]:
    folder = tmp_path_factory.mktemp("prod")
    (folder / "template.jinja").write_text(HOSTILE_TEMPLATE)
    (folder / "config.json5").write_text(f"""{{
        server: {{api_key: "{API_KEY}", max_request_bytes: {MAX_REQUEST_BYTES},
                  max_concurrent_requests: 2, max_queued_requests: 1, retry_after_seconds: {RETRY_AFTER_S}}},
        runtime: {{max_model_len: {MAX_MODEL_LEN}, max_batch_size: 4}},
        tokenizer: {{chat_template: "{folder / 'template.jinja'}"}},
    }}""")
    with bentoml_serve(".", bentoml_home, folder / "serve.log", {"LLGTRT_CONFIG": str(folder / "config.json5")}) as s:
        yield s


def completion(prompt: str = "The capital of France is", **extra) -> dict:
    return {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}


def test_v1_needs_the_bearer_key(prod: BentoServer) -> None:
    missing = httpx.get(f"{prod.url}/v1/models", timeout=10)
    wrong = httpx.get(f"{prod.url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{prod.url}/v1/completions", json=completion(), timeout=10).status_code == 401
    assert httpx.get(f"{prod.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    # Health and metrics stay open for probes and scrapers.
    for path in ("/livez", "/readyz", "/metrics"):
        assert httpx.get(f"{prod.url}{path}", timeout=10).status_code == 200


def test_the_openai_client_sends_the_key(prod: BentoServer) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{prod.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(**completion()).usage.completion_tokens == 8
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{prod.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_the_anthropic_client_sends_the_key(prod: BentoServer) -> None:
    import anthropic

    assert httpx.get(f"{prod.url}/v1/models", headers={"x-api-key": API_KEY}, timeout=10).status_code == 200
    client = anthropic.Anthropic(base_url=prod.url, api_key=API_KEY, max_retries=0)  # as x-api-key
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError, match="chat template"):  # past the key: this server's template
        client.messages.count_tokens(model="smollm2-135m-instruct", messages=messages)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=prod.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="smollm2-135m-instruct", messages=messages)


def test_a_body_past_the_limit_gets_413(prod: BentoServer) -> None:
    big = completion("hello " * (MAX_REQUEST_BYTES // 6 + 10))
    response = httpx.post(f"{prod.url}/v1/completions", json=big, headers=AUTH, timeout=10)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "too_large"

    def chunked():  # no Content-Length: counted as it arrives
        body = httpx.Request("POST", "/", json=big).content
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    response = httpx.post(f"{prod.url}/v1/completions", content=chunked(), timeout=10,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 413
    # Just under the limit still works.
    assert httpx.post(f"{prod.url}/v1/completions", json=completion(), headers=AUTH, timeout=60).status_code == 200


def test_a_prompt_longer_than_the_context_gets_400(prod: BentoServer) -> None:
    response = httpx.post(f"{prod.url}/v1/completions", json=completion("hello " * MAX_MODEL_LEN),
                          headers=AUTH, timeout=30)
    assert response.status_code == 400
    assert str(MAX_MODEL_LEN) in response.json()["error"]["message"]


def test_the_configured_chat_template_runs_sandboxed(prod: BentoServer) -> None:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(f"{prod.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 400
    assert "unsafe" in response.json()["error"]["message"]
    assert "uid=" not in response.text


def test_past_the_concurrency_and_queue_limits_a_request_gets_429(prod: BentoServer) -> None:
    long = completion("Once upon a time", max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, stream=True)
    with httpx.Client(headers=AUTH, timeout=60) as client:
        with client.stream("POST", f"{prod.url}/v1/completions", json=long) as first, \
                client.stream("POST", f"{prod.url}/v1/completions", json=long) as second:
            assert first.status_code == second.status_code == 200  # both places taken
            queued: dict[str, int] = {}

            def wait_in_queue() -> None:
                queued["status"] = httpx.post(f"{prod.url}/v1/completions", json=completion(), headers=AUTH,
                                              timeout=60).status_code

            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            time.sleep(1.0)  # the waiter now holds the one queue place
            assert "status" not in queued
            refused = client.post(f"{prod.url}/v1/completions", json=completion())
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
            assert refused.json()["error"]["type"] == "rate_limit_exceeded"
            tokenized = client.post(f"{prod.url}/v1/tokenize", json={"model": long["model"], "prompt": "hi"})
            assert tokenized.status_code == 200  # not a generation request: no place needed
        # Closing the streams frees the places: the queued request is served.
        waiter.join(timeout=60)
        assert queued["status"] == 200


def _samples(server: BentoServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f"{s.name}{sorted(s.labels.items()) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _settled_samples(server: BentoServer, timeout: float = 10.0) -> dict[str, float]:
    """The samples once our own have stopped moving: an earlier test's last request may still be
    folded into the deferred histograms (every half second) after it returned."""
    deadline = time.monotonic() + timeout
    previous = _samples(server)
    while True:
        time.sleep(0.6)
        now = _samples(server)
        ours = [name for name in now if name.startswith("llgtrt:")]
        if all(now[name] == previous.get(name) for name in ours) or time.monotonic() > deadline:
            return now
        previous = now


def _samples_once_grown(server: BentoServer, before: dict[str, float], growth: dict[str, float],
                        timeout: float = 5.0) -> dict[str, float]:
    """The samples once each name in `growth` has grown by at least that much past `before`, or at
    `timeout`: the engine thread records its state after the step, and deferred histograms (mask
    fill, TTFT, inter-token latency) are folded in every half second, each on its own thread."""
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.5)
        after = _samples(server)
        grown = all(after.get(name, 0.0) - before.get(name, 0.0) >= least for name, least in growth.items())
        if grown or time.monotonic() > deadline:
            return after


def test_metrics_count_requests_tokens_and_latencies(prod: BentoServer) -> None:
    before = _settled_samples(prod)
    constrained = completion("A JSON object:", max_tokens=12,
                             response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                                 "type": "object", "properties": {"x": {"type": "integer"}}}}})
    assert httpx.post(f"{prod.url}/v1/completions", json=completion(max_tokens=1), timeout=60).status_code == 401
    generated = 0
    for body in (completion(max_tokens=5), constrained):
        response = httpx.post(f"{prod.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200
        generated += response.json()["usage"]["completion_tokens"]
    after = _samples_once_grown(prod, before, {"llgtrt:grammar_mask_fill_seconds_count": 1,
                                               "llgtrt:time_to_first_token_seconds_count": 2,
                                               "llgtrt:inter_token_latency_seconds_count": 4})

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("llgtrt:prompt_tokens_total") >= 8
    assert grew("llgtrt:generation_tokens_total") == generated  # counted 16 at a time, the rest at the end
    assert grew("llgtrt:time_to_first_token_seconds_count") == 2
    assert grew("llgtrt:e2e_request_latency_seconds_count") == 2
    assert grew("llgtrt:request_queue_time_seconds_count") == 2
    assert grew("llgtrt:inter_token_latency_seconds_count") >= 4
    assert grew("llgtrt:grammar_mask_fill_seconds_count") >= 1
    # In the engine process only: the API worker sends the grammar's text.
    assert grew("llgtrt:grammar_compile_seconds_count") == 1
    assert grew("llgtrt:request_success_total[('finished_reason', 'length')]") >= 1
    assert after["llgtrt:num_requests_running"] == 0 and after["llgtrt:num_requests_waiting"] == 0
    assert after["llgtrt:kv_cache_usage_perc"] == 0
    # The refusal above, and BentoML's own metrics beside ours.
    assert grew("llgtrt:requests_rejected_total[('reason', 'unauthorized')]") == 1
    assert any(name.startswith("bentoml_service_request") for name in after)


def test_running_and_kv_usage_gauges_move_while_generating(prod: BentoServer) -> None:
    long = completion("Once upon a time", max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{prod.url}/v1/completions", json=long, headers=AUTH, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(10):
            next(lines)
        during = _samples(prod)
    assert during["llgtrt:num_requests_running"] == 1
    assert 0 < during["llgtrt:kv_cache_usage_perc"] < 1


def _histogram_samples(registry: CollectorRegistry) -> dict[str, float]:
    return {f"{s.name}{s.labels.get('le', '')}": s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


# Below, at and above bounds, and past the last one (+Inf).
VALUES = [0.00005, 0.0001, 0.0001001, 0.0007, 0.0025, 0.003, 0.3, 1.0, 7.0, 0.00002]


def test_observe_many_equals_one_observe_per_value() -> None:
    one_by_one, bulk = CollectorRegistry(), CollectorRegistry()
    buckets = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.25, 1.0)
    expected = Histogram("h_seconds", "h", buckets=buckets, registry=one_by_one)
    for value in VALUES:
        expected.observe(value)
    observe_many(Histogram("h_seconds", "h", buckets=buckets, registry=bulk), VALUES)
    want, got = _histogram_samples(one_by_one), _histogram_samples(bulk)
    assert got.keys() == want.keys() and got["h_seconds_count"] == len(VALUES)
    assert got == pytest.approx(want)


def test_a_deferred_histogram_reports_every_value_within_its_period() -> None:
    registry = CollectorRegistry()
    deferred = DeferredHistogram(Histogram("d_seconds", "d", buckets=(0.001, 0.01), registry=registry), period=0.05)
    for value in VALUES:
        deferred.observe(value)
    deadline = time.monotonic() + 5
    while _histogram_samples(registry)["d_seconds_count"] < len(VALUES) and time.monotonic() < deadline:
        time.sleep(0.01)  # the fold thread's work, not ours: observe only appended
    samples = _histogram_samples(registry)
    assert samples["d_seconds_count"] == len(VALUES)
    assert samples["d_seconds_sum"] == pytest.approx(sum(VALUES))
    assert samples["d_seconds_bucket0.001"] == sum(v <= 0.001 for v in VALUES)
