"""Admission (429) under a burst: requests that are in but have not yet planned (not yet at `admit`)
count against the free places, so a burst arriving all at once is cut at places + queue, however slow
the requests are to reach `admit` (CI failed on a 2-core machine where all 20 of a burst got in)."""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope, Send

from llgtrt_core.api.limits import AdmissionLimit, admit

PLACES = 4
QUEUED = 4
BURST = 20


async def burst_statuses() -> list[int]:
    """BURST requests into AdmissionLimit; each plans (admits) only once all of them are in."""
    release = asyncio.Event()

    async def planning_app(scope: Scope, receive: Receive, send: Send) -> None:
        await release.wait()  # the request's body is still being read and its prompts planned
        await admit(1)
        await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limit = AdmissionLimit(planning_app, PLACES, QUEUED, retry_after_s=1)

    async def one_request() -> int:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await limit({"type": "http", "method": "POST", "path": "/generate", "headers": []}, receive, send)
        return sent[0]["status"]

    tasks = [asyncio.create_task(one_request()) for _ in range(BURST)]
    await asyncio.sleep(0.05)  # every request is in, none has planned
    release.set()
    statuses = await asyncio.gather(*tasks)
    assert limit.num_waiting == 0 and limit.places is not None and limit.places.free == PLACES
    return statuses


def test_a_burst_before_anyone_plans_is_cut_at_places_plus_queue() -> None:
    statuses = asyncio.run(burst_statuses())
    assert statuses.count(200) == PLACES + QUEUED, statuses
    assert statuses.count(429) == BURST - PLACES - QUEUED, statuses

