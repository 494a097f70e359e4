"""The embedded engine in its own process, seen from outside: one engine process per server, and
what the server does when that process dies (streams end with an error event, readiness and new
requests answer 503, nothing hangs; then the owner API worker starts another and serves again)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from prometheus_client.parser import text_string_to_metric_families

from tests.bento_server import BentoServer, bentoml_serve

ENGINE_MODULE = "llgtrt_core.engine.core_process"


@pytest.fixture(scope="module")
def doomed(bentoml_home: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server of its own: the test kills its engine process."""
    log = tmp_path_factory.mktemp("engine-process") / "bentoml-serve.log"
    with bentoml_serve(".", bentoml_home, log) as server:
        yield server


def engine_processes(server: BentoServer) -> list[psutil.Process]:
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [p for p in children if ENGINE_MODULE in " ".join(p.cmdline())]


def chat(max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": "Write a very long story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}


def restarts(server: BentoServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "llgtrt:engine_process_restarts_total")


def test_a_dead_engine_process_ends_streams_with_an_error_and_the_server_says_so(doomed: BentoServer) -> None:
    engines = engine_processes(doomed)
    assert len(engines) == 1, [p.cmdline() for p in engines]
    url = f"{doomed.url}/v1/chat/completions"
    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url, json={**chat(4000), "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:
                        first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(timeout=60), doomed.log_tail()
    engines[0].kill()
    killed = time.monotonic()
    reader.join(timeout=30)
    assert not reader.is_alive(), "the stream hung after the engine process died"
    assert time.monotonic() - killed < 15
    errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
    assert errors and "engine process exited" in errors[0]["message"], events[-3:]
    assert httpx.get(f"{doomed.url}/readyz", timeout=10).status_code == 503
    refused = httpx.post(url, json=chat(4), timeout=30)
    assert refused.status_code == 503 and "engine process exited" in refused.json()["error"]["message"]

    # The owner starts another engine process (after a pause of 1 s): ready again, serving.
    deadline = time.monotonic() + 180
    while httpx.get(f"{doomed.url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "no engine process again:\n" + doomed.log_tail()
        time.sleep(0.5)
    served = httpx.post(url, json=chat(4), timeout=60)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4, served.text
    again = engine_processes(doomed)
    assert len(again) == 1 and again[0].pid != engines[0].pid
    assert restarts(doomed) == 1
