"""Several API workers in front of one engine process (`server.api_workers`): a server with two,
seen from outside (HTTP, processes, logs) and through a third client of the engine process, the
same `EngineCoreClient` a joining worker runs, driven from the test."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

import httpx
import psutil
import pytest

from llgtrt_core.config import Config, ConfigError
from llgtrt_core.engine.core_client import EngineCoreClient
from llgtrt_core.engine.factory import resolve_api_workers
from llgtrt_core.engine.core_protocol import CoreSpec
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from tests.bento_server import BentoServer, bentoml_serve

ENGINE_MODULE = "llgtrt_core.engine.core_process"
WORKER_MODULE = "_bentoml_impl.worker.service"


@pytest.fixture(scope="module")
def two_workers(bentoml_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BentoServer]:
    log = tmp_path_factory.mktemp("api-workers") / "bentoml-serve.log"
    with bentoml_serve(".", bentoml_home, log, env={"LLGTRT_API_WORKERS": "2"}) as server:
        # /readyz answered 200 from one worker; the other joins the engine a moment later.
        deadline, in_a_row = time.monotonic() + 120, 0
        while in_a_row < 20:  # through connections of their own: both workers, almost surely
            assert time.monotonic() < deadline, server.log_tail()
            ready = httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
            in_a_row = in_a_row + 1 if ready else 0
            time.sleep(0 if ready else 0.2)
        yield server


def processes(server: BentoServer, module: str) -> list[psutil.Process]:
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [p for p in children if module in " ".join(p.cmdline())]


def joining_client(server: BentoServer) -> EngineCoreClient:
    """A client of the server's engine process, as its second worker is (the socket is named after the
    workers' parent, the `bentoml serve` process)."""
    path = str(Path(tempfile.gettempdir()) / f"llgtrt-{os.getuid()}" / f"engine-{server.process.pid}.sock")
    return EngineCoreClient(CoreSpec("", None, 0, (), listen_path=path), owner=False)


async def generate(client: EngineCoreClient, request_id: str, max_tokens: int) -> tuple[list[int], Optional[str]]:
    tokens: list[int] = []
    request = GenerationRequest(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, temperature=0))
    async for delta in client.generate(request):
        tokens += delta.token_ids
        if delta.finish_reason is not None:
            return tokens, delta.finish_reason
    return tokens, None


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 12, "temperature": 0,
            "response_format": {"type": "json_object"}}


def test_two_workers_serve_through_one_engine_process(two_workers: BentoServer) -> None:
    assert len(processes(two_workers, WORKER_MODULE)) == 2
    assert len(processes(two_workers, ENGINE_MODULE)) == 1
    url = f"{two_workers.url}/v1/chat/completions"

    def one(i: int) -> dict:  # a connection of its own, so the kernel may hand it to either worker
        with httpx.Client(timeout=120) as client:
            response = client.post(url, json=chat(i))
            assert response.status_code == 200, response.text
            return response.json()

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(48)))
    for answer in answers:
        choice = answer["choices"][0]
        if choice["finish_reason"] == "stop":
            json.loads(choice["message"]["content"])
    served = set(re.findall(r"\[entry_service:llgtrt:(\d)\][^\n]*path=/v1/chat/completions[^\n]*status=200",
                            two_workers.log.read_text(errors="replace")))
    assert served == {"1", "2"}, two_workers.log_tail()


def test_requests_of_different_workers_with_the_same_id_stay_apart(two_workers: BentoServer) -> None:
    async def run() -> list[tuple[list[int], Optional[str]]]:
        first, second = joining_client(two_workers), joining_client(two_workers)
        await asyncio.gather(first.start(), second.start())
        try:
            return await asyncio.gather(generate(first, "same-id", 5), generate(second, "same-id", 9))
        finally:
            await asyncio.gather(first.shutdown(), second.shutdown())

    (tokens_a, reason_a), (tokens_b, reason_b) = asyncio.run(run())
    assert (len(tokens_a), reason_a, len(tokens_b), reason_b) == (5, "length", 9, "length")
    assert tokens_a == tokens_b[:5]  # the same greedy continuation of the same prompt


def metric(server: BentoServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_a_worker_that_goes_away_has_its_requests_aborted(two_workers: BentoServer) -> None:
    async def start_and_vanish() -> None:
        client = joining_client(two_workers)
        await client.start()
        request = GenerationRequest("long", [1, 2, 3], SamplingParams(max_tokens=100_000, temperature=0))
        stream = client.generate(request)
        await anext(stream)  # accepted
        await anext(stream)  # generating
        await client.shutdown()  # closes the connection, as a dying worker's does, with no abort sent

    asyncio.run(start_and_vanish())
    deadline = time.monotonic() + 30
    while metric(two_workers, "llgtrt:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the vanished worker's request still runs"
        time.sleep(0.5)


def test_a_joining_worker_rejoins_the_engine_of_a_restarted_owner(two_workers: BentoServer) -> None:
    async def run() -> None:
        client = joining_client(two_workers)
        await client.start()
        try:
            assert (await generate(client, "before", 3))[1] == "length"
            owner = next(p for p in processes(two_workers, WORKER_MODULE)
                         if any(ENGINE_MODULE in " ".join(c.cmdline()) for c in p.children()))
            owner.send_signal(signal.SIGKILL)  # BentoML starts a new first worker, which starts a new engine
            deadline = time.monotonic() + 30
            while client.failure is None:
                assert time.monotonic() < deadline, "the lost engine process went unnoticed"
                await asyncio.sleep(0.1)
            deadline = time.monotonic() + 180
            while client.failure is not None:
                assert time.monotonic() < deadline, "never rejoined:\n" + two_workers.log_tail()
                await asyncio.sleep(0.5)
            assert await generate(client, "after", 3) == ((await generate(client, "again", 3))[0], "length")
        finally:
            await client.shutdown()

    asyncio.run(run())
    deadline = time.monotonic() + 120
    while httpx.get(f"{two_workers.url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert len(processes(two_workers, ENGINE_MODULE)) == 1


def test_the_owner_stopping_lets_the_other_workers_requests_end(two_workers: BentoServer) -> None:
    """Last of the server's tests: it stops the server (SIGTERM to its process group, as `stop` does)."""
    async def run() -> tuple[list[int], Optional[str]]:
        client = joining_client(two_workers)
        await client.start()
        tokens: list[int] = []
        reason = None
        stream = client.generate(GenerationRequest("drained", [1, 2, 3, 4, 5],
                                                   SamplingParams(max_tokens=400, temperature=0)))
        try:
            await anext(stream)  # accepted
            os.killpg(two_workers.process.pid, signal.SIGTERM)
            async for delta in stream:
                tokens += delta.token_ids
                reason = delta.finish_reason or reason
        finally:
            await client.shutdown()
        return tokens, reason

    tokens, reason = asyncio.run(run())
    assert (len(tokens), reason) == (400, "length"), two_workers.log_tail()
    two_workers.process.wait(timeout=120)


@pytest.mark.parametrize(("configured", "device", "kind", "expected"), [
    (3, "cuda", "pytorch", 3),  # a configured number stays
    (None, "cpu", "pytorch", 1),  # the engine needs the cores
    (None, "cuda", "tensorrt_llm", 1),  # its executor runs in the API worker's process
    (None, "cuda", "pytorch", min(4, max(1, (os.cpu_count() or 1) // 4))),
])
def test_api_workers_by_default(configured: Optional[int], device: str, kind: str, expected: int) -> None:
    config = Config.from_mapping({"server": {"api_workers": configured}, "runtime": {"device": device}})
    assert resolve_api_workers(config, kind).server.api_workers == expected


def test_api_workers_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"server\.api_workers"):
        Config.from_mapping({"server": {"api_workers": 0}})
