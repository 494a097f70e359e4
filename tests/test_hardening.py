"""What hostile and careless clients found (issue 19), kept fixed: against a real `bentoml serve`
with an API key and small limits, every generating route (/v1 and bentoml's /generate) gets the same
key, body limit, fan-out bound and admission; bad input is a 400 naming the field, never a 500; big
inputs do not stall the event loop; /metrics does not grow with unknown paths. Ends with a bounded
chaos run (concurrent streams, disconnects, oversized and malformed requests) that must leave the
server as it found it."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bento_server import BentoServer, bentoml_serve, free_port

MODEL = "smollm2-135m-instruct"
API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUEST_BYTES = 6_000_000
MAX_CONCURRENT = 4
MAX_QUEUED = 4
MAX_SEQUENCES = 8
MAX_PROMPT_CHARS = 2_500_000
MAX_MESSAGES = 4096
MAX_TOOLS = 4
LIVEZ_BOUND_S = 1.0
MIN_WORK_S = 0.3  # a stall shorter than this is lost among the probes' own latencies


@pytest.fixture(scope="module")
def hardened(bentoml_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BentoServer]:
    folder = tmp_path_factory.mktemp("hardening")
    (folder / "config.json5").write_text(f"""{{
        server: {{api_key: "{API_KEY}", max_request_bytes: {MAX_REQUEST_BYTES},
                  max_concurrent_requests: {MAX_CONCURRENT}, max_queued_requests: {MAX_QUEUED},
                  max_sequences_per_request: {MAX_SEQUENCES}, max_prompt_chars: {MAX_PROMPT_CHARS},
                  max_messages: {MAX_MESSAGES}, max_tools: {MAX_TOOLS}}},
        runtime: {{max_batch_size: 8}},
    }}""")
    with bentoml_serve(".", bentoml_home, folder / "serve.log", {"LLGTRT_CONFIG": str(folder / "config.json5")}) as s:
        yield s


def completion(prompt: object = "The capital of France is", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def chat(content: str = "Hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **extra}


def post(server: BentoServer, path: str, body: object, timeout: float = 60, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=timeout, **kwargs)


def assert_400(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"], error
    return error


def engine_active(server: BentoServer) -> int:
    return httpx.get(f"{server.url}/v1/engine/stats", headers=AUTH, timeout=10).json()["num_active"]


# --------------------------------------------------------------------------- fan-out and admission


def test_a_request_fanning_out_past_the_bound_is_a_400_naming_the_fields(hardened: BentoServer) -> None:
    error = assert_400(post(hardened, "/v1/completions", completion(["Hi"] * 5, n=2)), "n")
    assert "prompt" in error["message"] and "n" in error["message"] and str(MAX_SEQUENCES) in error["message"]
    error = assert_400(post(hardened, "/v1/completions", completion(["Hi"] * 3, n=2, best_of=3)), "best_of")
    assert "best_of" in error["message"]
    assert_400(post(hardened, "/v1/chat/completions", chat(n=MAX_SEQUENCES + 1)), "n")
    # At the bound it runs.
    response = post(hardened, "/v1/completions", completion(["Hi"] * 4, n=2, max_tokens=1))
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_SEQUENCES
    assert engine_active(hardened) == 0


def test_every_sequence_counts_against_admission(hardened: BentoServer) -> None:
    """A stream of n = MAX_CONCURRENT sequences holds every place: a one-sequence request waits for it."""
    wide = completion("Once upon a time", n=MAX_CONCURRENT, max_tokens=200, ignore_eos=True, stream=True)
    finished: dict[str, float] = {}

    def one_more() -> None:
        assert post(hardened, "/v1/completions", completion(max_tokens=1)).status_code == 200
        finished["at"] = time.monotonic()

    with httpx.stream("POST", f"{hardened.url}/v1/completions", json=wide, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        waiter = threading.Thread(target=one_more)
        waiter.start()
        time.sleep(1.5)
        assert "at" not in finished, "admitted while every place was taken"
        closed = time.monotonic()
    waiter.join(timeout=60)
    assert finished["at"] >= closed


# --------------------------------------------------------------------------- per-field limits, off the event loop


def test_fields_past_their_limits_are_400s_before_any_work(hardened: BentoServer) -> None:
    too_long = "a" * (MAX_PROMPT_CHARS + 1)
    assert_400(post(hardened, "/v1/completions", completion(too_long)), "prompt")
    assert_400(post(hardened, "/v1/completions", completion([too_long[:MAX_PROMPT_CHARS // 2 + 1]] * 2)), "prompt")
    assert_400(post(hardened, "/v1/chat/completions", chat(too_long)), "messages")
    assert_400(post(hardened, "/v1/tokenize", {"model": MODEL, "prompt": too_long}), "prompt")
    many = [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    assert_400(post(hardened, "/v1/chat/completions", {"model": MODEL, "messages": many}), "messages")
    assert_400(post(hardened, "/v1/tokenize", {"model": MODEL, "messages": many}), "messages")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert_400(post(hardened, "/v1/chat/completions", chat(tools=[tool] * (MAX_TOOLS + 1))), "tools")


@pytest.mark.parametrize("kind", ["completion", "tokenize", "chat", "schema"])
def test_livez_answers_while_a_huge_allowed_input_is_processed(hardened: BentoServer, kind: str) -> None:
    words = " ".join(random.Random(0).choice(["alpha", "beta", "gamma", "delta"]) for _ in range(400_000))
    if kind == "completion":  # tokenized, then refused for the context length
        path, body = "/v1/completions", completion(words)
    elif kind == "tokenize":
        path, body = "/v1/tokenize", {"model": MODEL, "prompt": words}
    elif kind == "chat":  # the chat template over many long messages, then the tokenizer
        messages = [{"role": "user", "content": words[i: i + 1000]} for i in range(0, 2_000_000, 1000)]
        path, body = "/v1/tokenize", {"model": MODEL, "messages": messages}
    else:  # a schema of 3.8 MB: its copy with number bounds and its grammar text, then refused for its length
        numbers = {f"q{j}": {"type": "number"} for j in range(8)}
        schema = {"type": "object", "properties": {f"p{i}": {"type": "object", "properties": numbers} for i in range(15000)}}
        path, body = "/v1/chat/completions", chat(response_format={"type": "json_schema",
                                                                   "json_schema": {"name": "big", "schema": schema}})
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(f"{hardened.url}/livez").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        response = post(hardened, path, body, timeout=120)
        took = time.monotonic() - started
    finally:
        done.set()
        prober.join(timeout=30)
    assert response.status_code in (200, 400) and response.status_code < 500, response.text[:300]
    if kind == "schema":
        assert "llguidance.max_grammar_chars" in assert_400(response, "response_format.json_schema")["message"]
    assert took > MIN_WORK_S, f"the work took only {took:.2f} s: too little to show a stall"
    # Held on the event loop, the work stalled /livez for all of it (2-5 s here: the probe in flight when
    # it started waited until it ended); off it, what is left is parsing the body and CPU time shared
    # with other jobs on 2 cores. A fast machine does the work in about the bound itself, so a stall is
    # also measured against the work's own time.
    assert max(latencies) < min(LIVEZ_BOUND_S, took / 2), \
        f"/livez took {max(latencies):.2f} s while the prompt was processed ({took:.2f} s)"


# --------------------------------------------------------------------------- bentoml's /generate


def test_generate_has_the_same_key_limits_and_400s_as_v1(hardened: BentoServer) -> None:
    url = f"{hardened.url}/generate"
    body = {"prompt": "The capital of France is", "max_tokens": 3}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30).status_code == 401
    ok = httpx.post(url, json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.text
    big = {"prompt": "hello " * (MAX_REQUEST_BYTES // 6 + 10), "max_tokens": 1}
    assert httpx.post(url, json=big, headers=AUTH, timeout=30).status_code == 413
    for bad in ({"prompt": "Hi", "max_tokens": 10**9}, {"prompt": "hello " * 9000, "max_tokens": 1},
                {"prompt": "\ud800", "max_tokens": 1}, {"prompt": "a" * (MAX_PROMPT_CHARS + 1)}):
        response = httpx.post(url, content=json.dumps(bad), headers={**AUTH, "Content-Type": "application/json"},
                              timeout=60)
        assert response.status_code == 400, (response.status_code, response.text[:300])


def test_generate_is_admitted_like_v1(hardened: BentoServer) -> None:
    """Past MAX_CONCURRENT running and MAX_QUEUED waiting, /generate gets 429 too."""
    body = {"prompt": "Once upon a time", "max_tokens": 60}

    def call(_: int) -> int:
        return httpx.post(f"{hardened.url}/generate", json=body, headers=AUTH, timeout=120).status_code

    with ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(call, range(20)))
    assert statuses.count(429) >= 20 - MAX_CONCURRENT - MAX_QUEUED - 2, statuses  # a few may start after others end
    assert set(statuses) <= {200, 429}, statuses
    assert engine_active(hardened) == 0


def test_the_bentoml_client_still_streams(hardened: BentoServer) -> None:
    import bentoml

    with bentoml.SyncHTTPClient(hardened.url, token=API_KEY) as client:
        text = "".join(client.generate(prompt="The capital of France is", max_tokens=6))
    assert text


# --------------------------------------------------------------------------- bad input: 400 naming the field


SURROGATE = "\ud800"
DEEP = {"type": "object", "properties": {}}
_inner = DEEP
for _ in range(300):
    _next = {"type": "object", "properties": {}}
    _inner["properties"]["x"] = _next
    _inner = _next

BAD_INPUTS = [
    ("/v1/chat/completions", chat(SURROGATE), "messages[0].content"),
    ("/v1/completions", completion(SURROGATE), "prompt"),
    ("/v1/completions", completion(["ok", SURROGATE]), "prompt[1]"),
    ("/v1/tokenize", {"model": MODEL, "prompt": SURROGATE}, "prompt"),
    ("/v1/completions", completion(structured_outputs={"regex": SURROGATE + "+"}), "structured_outputs.regex"),
    ("/v1/completions", completion(model=SURROGATE), "model"),
    ("/v1/completions", completion(logit_bias={"\u00b2": 1}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"9" * 5000: 1}), "logit_bias"),
    ("/v1/completions", completion(stream="yes"), "stream"),
]


@pytest.mark.parametrize("path,body,param", BAD_INPUTS, ids=[
    "surrogate-message", "surrogate-prompt", "surrogate-prompt-list", "surrogate-tokenize", "surrogate-regex",
    "surrogate-model", "logit-bias-superscript", "logit-bias-5000-digits", "stream-yes"])
def test_bad_input_is_a_400_naming_the_field(hardened: BentoServer, path: str, body: dict, param: str) -> None:
    response = httpx.post(f"{hardened.url}{path}", content=json.dumps(body),
                          headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert_400(response, param)


def test_a_deeply_nested_closed_schema_is_not_a_500(hardened: BentoServer) -> None:
    body = completion(structured_outputs={"json": DEEP, "disable_additional_properties": True}, max_tokens=2)
    response = httpx.post(f"{hardened.url}/v1/completions", content=json.dumps(body),
                          headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert response.status_code in (200, 400), response.text[:300]
    if response.status_code == 400:
        assert response.json()["error"]["param"] == "structured_outputs.json"


def test_grammar_errors_are_readable_and_name_the_field(hardened: BentoServer) -> None:
    recursive = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    error = assert_400(post(hardened, "/v1/completions", completion(structured_outputs={"json": recursive})),
                       "structured_outputs.json")
    assert error["message"] != "NoExtensionBias" and "ref" in error["message"].lower(), error
    error = assert_400(post(hardened, "/v1/completions", completion(structured_outputs={"grammar": "root ::= "})),
                       "structured_outputs.grammar")
    assert "empty" in error["message"].lower(), error
    assert_400(post(hardened, "/v1/completions", completion(structured_outputs={"regex": "(unclosed"})),
               "structured_outputs.regex")
    assert_400(post(hardened, "/v1/chat/completions", chat(response_format={"type": "lark_grammar",
                                                                            "lark_grammar": "start: nope"})),
               "response_format.lark_grammar")


def test_a_405_names_the_allowed_methods(hardened: BentoServer) -> None:
    response = httpx.get(f"{hardened.url}/v1/chat/completions", headers=AUTH, timeout=10)
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"


def test_a_500_keeps_the_keep_alive_connection() -> None:
    """The OpenAI app served by uvicorn (as BentoML serves it), with one route that fails unexpectedly:
    after its 500 the client's next request on the same pooled connection still works."""
    import uvicorn

    from llgtrt_core.api.app import create_app

    app = create_app(lambda: None)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("unexpected")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # one socket, never reopened
        connection.request("GET", "/boom")
        failed = connection.getresponse()
        assert failed.status == 500 and json.loads(failed.read())["error"]["type"] == "server_error"
        time.sleep(0.2)  # a reset would have happened by now
        for path, status in (("/models", 503), ("/boom", 500)):
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            assert response.status == status
        connection.close()
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# --------------------------------------------------------------------------- /metrics


def _series(server: BentoServer) -> tuple[int, set[str]]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    endpoints = {s.labels["endpoint"] for family in text_string_to_metric_families(text) for s in family.samples
                 if "endpoint" in s.labels}
    return len(text), endpoints


def test_unknown_paths_share_one_metrics_label(hardened: BentoServer) -> None:
    with httpx.Client(timeout=10) as client:
        for i in range(40):
            assert client.get(f"{hardened.url}/scan-{i}/wp-login.php").status_code == 404
            client.get(f"{hardened.url}/v1/scan-{i}", headers=AUTH)
    _, endpoints = _series(hardened)
    assert not any("scan-" in e for e in endpoints), sorted(endpoints)[:20]
    size_before, _ = _series(hardened)
    with httpx.Client(timeout=10) as client:
        for i in range(40, 80):
            client.get(f"{hardened.url}/scan-{i}")
    size_after, _ = _series(hardened)
    assert size_after - size_before < 2000, (size_before, size_after)


# --------------------------------------------------------------------------- chaos


CHAOS_SECONDS = 20
CHAOS_CLIENTS = 4  # half stream, half abuse: modest load for 2 shared cores
STALL_S = 1.0


def _rss_kb(server: BentoServer) -> int:
    import psutil

    processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in processes if p.is_running()) // 1024


def _gaps(url: str, body: dict) -> list[float]:
    """Seconds between consecutive events of one stream."""
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        stamps += [time.monotonic() for line in response.iter_lines() if line.startswith("data: ")]
    return [later - earlier for earlier, later in zip(stamps, stamps[1:])]


def test_chaos_leaves_no_5xx_no_stall_and_no_leak(hardened: BentoServer) -> None:
    """Streams (some cut by their client), oversized, malformed and unauthorized requests at once,
    for CHAOS_SECONDS: no 5xx, no stream silent for longer than STALL_S (see stall_bound), and
    afterwards no engine request left, every admission place free, and the memory back within bounds."""
    seed = random.randrange(2**32)
    print(f"chaos seed {seed}")
    url = hardened.url
    failures: list[str] = []
    stalls: list[float] = []
    statuses: list[int] = []
    lock = threading.Lock()
    # Warm up (first requests allocate the KV cache and caches), then measure the baseline.
    for _ in range(3):
        assert post(hardened, "/v1/chat/completions", chat(max_tokens=8, n=2)).status_code == 200
    rss_before = _rss_kb(hardened)
    # On a quiet machine the bound is STALL_S. Where clean streams, as many as the chaos runs, already
    # pause longer (the 2 cores shared with other jobs), it is twice their longest pause.
    calm = completion("Once", max_tokens=32, ignore_eos=True, stream=True)
    with ThreadPoolExecutor(CHAOS_CLIENTS // 2) as pool:
        calm_gaps = [gap for gaps in pool.map(lambda _: _gaps(url, calm), range(CHAOS_CLIENTS // 2)) for gap in gaps]
    stall_bound = max(STALL_S, 2 * max(calm_gaps))
    deadline = time.monotonic() + CHAOS_SECONDS

    def stream(rng: random.Random, client: httpx.Client) -> None:
        body = (chat("Tell me a story.", max_tokens=rng.randint(8, 32), stream=True)
                if rng.random() < 0.5 else completion("Once", max_tokens=rng.randint(8, 32), stream=True))
        hang_up_after = rng.choice([None, None, 1, 3, 8])
        with client.stream("POST", f"{url}{'/v1/chat/completions' if 'messages' in body else '/v1/completions'}",
                           json=body, headers=AUTH) as response:
            with lock:
                statuses.append(response.status_code)
            if response.status_code != 200:
                response.read()
                return
            # Silence is measured from the first token on: before it come admission and prefill (and a
            # chat's role chunk, sent before either).
            last = None
            events = 0
            first_token = 1 if "messages" in body else 0
            for line in response.iter_lines():
                now = time.monotonic()
                if line.startswith("data: "):
                    if last is not None:
                        with lock:
                            stalls.append(now - last)
                    if events >= first_token:
                        last = now
                    events += 1
                    if hang_up_after is not None and events >= hang_up_after:
                        return  # the client goes away mid-stream
                    if line == "data: [DONE]":
                        return
            with lock:
                failures.append("a stream ended without [DONE]")

    def abuse(rng: random.Random, client: httpx.Client) -> None:
        kind = rng.randrange(6)
        headers = {**AUTH, "Content-Type": "application/json"}
        if kind == 0:
            response = client.post(f"{url}/v1/completions", content=b"x" * (MAX_REQUEST_BYTES + 1), headers=headers)
        elif kind == 1:
            response = client.post(f"{url}/v1/chat/completions", content=b'{"messages": [', headers=headers)
        elif kind == 2:
            response = client.post(f"{url}/v1/completions", json=completion(["Hi"] * 50, n=10), headers=AUTH)
        elif kind == 3:
            response = client.post(f"{url}/v1/completions", content=json.dumps(completion(SURROGATE)), headers=headers)
        elif kind == 4:
            response = client.post(f"{url}/v1/completions", json=completion())  # no key
        else:
            response = client.post(f"{url}/generate", json={"prompt": "Hi", "max_tokens": 3}, headers=AUTH)
        with lock:
            statuses.append(response.status_code)
        time.sleep(0.05)

    def client_loop(index: int) -> None:
        rng = random.Random(seed + index)
        with httpx.Client(timeout=60) as client:
            while time.monotonic() < deadline:
                try:
                    (stream if index % 2 == 0 else abuse)(rng, client)
                except httpx.HTTPError as e:
                    with lock:
                        failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CHAOS_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=CHAOS_SECONDS + 60)
    assert not failures, failures[:5]
    assert statuses and max(statuses) < 500, sorted(set(statuses))
    assert 200 in statuses
    print(f"longest silence {max(stalls):.2f} s, bound {stall_bound:.2f} s")
    assert max(stalls) < stall_bound, f"a stream was silent for {max(stalls):.2f} s (seed {seed})"
    time.sleep(1.0)
    assert engine_active(hardened) == 0
    # Every place is free again: MAX_CONCURRENT wide requests are admitted at once.
    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        results = list(pool.map(lambda _: post(hardened, "/v1/completions", completion(max_tokens=1)).status_code,
                                range(MAX_CONCURRENT)))
    assert results == [200] * MAX_CONCURRENT
    rss_after = _rss_kb(hardened)
    assert rss_after - rss_before < 200_000, f"memory grew by {(rss_after - rss_before) / 1024:.0f} MB (seed {seed})"

