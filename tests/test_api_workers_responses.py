"""Stored responses with several API workers (`server.api_workers`): every worker finds, continues,
deletes and cancels the responses any of them stored. The kernel may hand a whole run of new
connections to one worker, so the calls that must reach a given worker go through a connection it
accepted (`clients_by_worker`: the access log says which worker served what)."""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import openai
import pytest

from tests.bento_server import BentoServer
from tests.test_api_workers import two_workers  # noqa: F401 (the fixture: a server with two workers)

T = TypeVar("T")
DIGITS = {"type": "json_schema", "name": "digits", "schema": {  # cannot end early
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400}}


def fresh(server: BentoServer, call: Callable[[openai.OpenAI], T]) -> T:
    """`call` through a client (and so a connection) of its own."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        return call(client)


def workers_that_served(server: BentoServer, path_pattern: str) -> set[str]:
    return set(re.findall(rf"\[entry_service:llgtrt:(\d)\][^\n]*path={path_pattern}[^\n]*status=200",
                          server.log.read_text(errors="replace")))


@pytest.fixture(scope="module")
def model(two_workers: BentoServer) -> str:  # noqa: F811
    """The model's name, once both workers serve it (/readyz answered 200 from one of them)."""
    deadline, answered = time.monotonic() + 120, 0
    while answered < 20:  # in a row, through connections of their own: both workers, almost surely
        assert time.monotonic() < deadline, two_workers.log_tail()
        try:
            name = fresh(two_workers, lambda client: client.models.list().data[0].id)
            answered += 1
        except openai.InternalServerError:  # 503: that worker is still loading
            answered = 0
            time.sleep(0.5)
    return name


def test_every_worker_continues_gets_and_deletes_every_stored_response(two_workers: BentoServer,  # noqa: F811
                                                                       model: str) -> None:
    def create(i: int) -> Any:
        return fresh(two_workers, lambda c: c.responses.create(model=model, input=f"Say {i}.", max_output_tokens=4,
                                                               temperature=0))

    with ThreadPoolExecutor(6) as pool:
        firsts = list(pool.map(create, range(6)))
    # Each response is read, continued and deleted through workers chosen on purpose (the kernel may
    # hand a whole run of new connections to one worker): in turn the one that stored it or not.
    for i, first in enumerate(firsts):
        pinned = clients_by_worker(two_workers)
        reader, writer = (pinned["1"], pinned["2"]) if i % 2 else (pinned["2"], pinned["1"])
        retrieved = reader.responses.retrieve(first.id)
        second = writer.responses.create(model=model, input="Again.", max_output_tokens=4, temperature=0,
                                         previous_response_id=first.id)
        assert (retrieved.id, retrieved.status, retrieved.output_text) == (first.id, first.status, first.output_text)
        assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
        # The follow-up's prompt held the first exchange: more input tokens than "Again." alone.
        assert second.usage.input_tokens > first.usage.input_tokens
        reader.responses.delete(first.id)  # 404 raises
        with pytest.raises(openai.NotFoundError):
            writer.responses.retrieve(first.id)
        for client in pinned.values():
            client.close()
    assert workers_that_served(two_workers, "/v1/responses/resp_[0-9a-f]+") == {"1", "2"}, two_workers.log_tail()
    assert workers_that_served(two_workers, "/v1/responses,") == {"1", "2"}, two_workers.log_tail()


def clients_by_worker(server: BentoServer, tries: int = 10) -> dict[str, openai.OpenAI]:
    """A client whose kept-alive connection one worker accepted, for each worker. The kernel hands an
    idle server's new connections to one worker for long runs, so connect several at once, each with a
    call the access log names (a 404 for a model no one has), and keep one per worker. Use them within
    the server's keep-alive (5 s)."""
    for _ in range(tries):
        probe = f"probe-{uuid.uuid4().hex}"
        clients = [openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
                   for _ in range(8)]

        def connect(i: int) -> None:
            with pytest.raises(openai.NotFoundError):
                clients[i].models.retrieve(f"{probe}-{i}")

        with ThreadPoolExecutor(len(clients)) as pool:
            list(pool.map(connect, range(len(clients))))
        pattern = rf"\[entry_service:llgtrt:(\d)\][^\n]*path=/v1/models/{probe}-(\d)[ ,]"
        deadline, served = time.monotonic() + 10, {}
        while len(served) < len(clients) and time.monotonic() < deadline:  # the access log lags a little
            served = {int(i): worker for worker, i in re.findall(pattern, server.log.read_text(errors="replace"))}
            time.sleep(0.05)
        chosen = {worker: clients[i] for i, worker in served.items()}
        for client in set(clients) - set(chosen.values()):
            client.close()
        if set(chosen) == {"1", "2"}:
            return chosen
        for client in chosen.values():
            client.close()
    raise AssertionError(f"no connection reached both workers in {tries} tries\n{server.log_tail()}")


def test_a_cancel_through_any_worker_stops_a_streamed_response(two_workers: BentoServer,  # noqa: F811
                                                               model: str) -> None:
    for worker in ("1", "2"):  # the stream's worker and the cancel's differ in one of the two rounds
        with openai.OpenAI(base_url=f"{two_workers.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            stream = client.responses.create(model=model, input="Digits please.", stream=True, temperature=0,
                                             max_output_tokens=3000, text={"format": DIGITS})
            events = iter(stream)
            created = next(events)
            assert fresh(two_workers, lambda c: c.responses.retrieve(created.response.id)).status == "in_progress"
            pinned = clients_by_worker(two_workers)
            assert pinned[worker].responses.cancel(created.response.id).status == "cancelled"
            for other in pinned.values():
                other.close()
            rest = list(events)
        assert rest[-1].type == "response.failed" and rest[-1].response.status == "cancelled"
        assert len(rest[-1].response.output_text) < 800  # stopped long before the 400 digits
        assert fresh(two_workers, lambda c: c.responses.retrieve(created.response.id)).status == "cancelled"
        assert worker in workers_that_served(two_workers, "/v1/responses/resp_[0-9a-f]+/cancel,"), \
            two_workers.log_tail()
