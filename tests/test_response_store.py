"""The response stores' bounds (the oldest responses go first past the size, each expires after its
time-to-live; a fake clock), the same for the in-memory store of one API worker and the shared
one of several; and the shared one seen from two stores on one file, as two workers see it (in one
process, and in two). No server needed."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import os
import sqlite3
from pathlib import Path
from typing import Callable

import pytest

from llgtrt_core.api.response_store import MemoryResponseStore, ResponseStore, StoredResponse
from llgtrt_core.api.response_store_shared import CANCEL_POLL_S, SharedResponseStore
from llgtrt_core.api.responses_protocol import MessageItem, ResponseObject
from llgtrt_core.server_files import private_folder, remove_stale_server_files


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(response_id: str, status: str = "completed") -> StoredResponse:
    return StoredResponse(ResponseObject(id=response_id, model="m", status=status),
                          input_items=[MessageItem(role="user", content=f"about {response_id}")])


StoreFactory = Callable[..., ResponseStore]


@pytest.fixture(params=["memory", "shared"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    if request.param == "memory":
        return MemoryResponseStore
    return lambda max_size, ttl_s, **kw: SharedResponseStore(max_size, ttl_s, path=str(tmp_path / "r.sqlite3"), **kw)


def test_the_oldest_go_first_past_the_size(make_store: StoreFactory) -> None:
    store = make_store(max_size=2, ttl_s=60, clock=Clock())
    for response_id in ("a", "b", "c"):
        store.put(entry(response_id))
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None


def test_storing_again_refreshes_age_and_order(make_store: StoreFactory) -> None:
    clock = Clock()
    store = make_store(max_size=2, ttl_s=10, clock=clock)
    a, b = entry("a"), entry("b")
    store.put(a)
    store.put(b)
    clock.now = 5
    store.put(a)  # a response that ended is stored again: it is now the newest
    store.put(entry("c"))
    assert store.get("b") is None and store.get("a").input_items == a.input_items
    clock.now = 14.9
    assert store.get("a").response == a.response
    clock.now = 15.1
    assert store.get("a") is None and store.get("c") is None


def test_size_zero_stores_nothing_and_delete_says_whether_it_held_one(make_store: StoreFactory) -> None:
    empty = make_store(max_size=0, ttl_s=60)
    empty.put(entry("a"))
    assert empty.get("a") is None and not empty.delete("a")
    store = make_store(max_size=1, ttl_s=60)
    store.put(entry("a"))
    assert store.delete("a") and not store.delete("a")


def test_only_a_response_in_progress_is_cancelled(make_store: StoreFactory) -> None:
    async def run() -> None:
        store = make_store(max_size=4, ttl_s=60)
        running, ended = entry("running", "in_progress"), entry("ended")
        store.put(running)
        store.put(ended)
        assert store.cancel("running").response.status == "cancelled" and running.stop.is_set()
        assert store.get("running").response.status == "cancelled"
        assert store.cancel("ended").response.status == "completed" and store.cancel("unknown") is None

    asyncio.run(run())


def two_stores_on_one_file(tmp_path: Path, max_size: int) -> tuple[SharedResponseStore, SharedResponseStore]:
    """As two API workers of one server see the file."""
    path = str(tmp_path / "r.sqlite3")
    return SharedResponseStore(max_size, 60, path=path), SharedResponseStore(max_size, 60, path=path)


def test_two_shared_stores_on_one_file_see_one_set_of_responses(tmp_path: Path) -> None:
    first, second = two_stores_on_one_file(tmp_path, max_size=2)
    stored = entry("a")
    first.put(stored)
    seen = second.get("a")
    assert seen.response == stored.response and seen.input_items == stored.input_items
    second.put(entry("b"))
    first.put(entry("c"))  # the count is the file's, not each store's
    assert second.get("a") is None and first.get("b") is not None
    assert second.delete("b") and first.get("b") is None and not first.delete("b")


def test_a_cancel_in_one_shared_store_stops_the_response_another_runs(tmp_path: Path) -> None:
    async def run() -> None:
        runner, other = two_stores_on_one_file(tmp_path, max_size=4)
        running = entry("r", "in_progress")
        runner.put(running)
        assert other.get("r").response.status == "in_progress"
        assert other.cancel("r").response.status == "cancelled"
        await asyncio.wait_for(running.stop.wait(), timeout=10 * CANCEL_POLL_S)
        assert running.response.status == "cancelled"
        runner.put(running)  # the runner stores how it ended
        assert other.get("r").response.status == "cancelled"

    asyncio.run(run())


def test_a_cancel_made_before_the_end_was_stored_wins(tmp_path: Path) -> None:
    async def run() -> None:
        runner, other = two_stores_on_one_file(tmp_path, max_size=4)
        running = entry("r", "in_progress")
        runner.put(running)
        other.cancel("r")  # the client was told "cancelled"...
        running.response.status = "completed"  # ...while the runner finished, before its poll saw it
        runner.put(running)
        assert running.stop.is_set() and running.response.status == "cancelled"
        assert other.get("r").response.status == "cancelled"

    asyncio.run(run())


def _run_until_cancelled(path: str, ready: multiprocessing.Queue, result: multiprocessing.Queue) -> None:
    async def run() -> str:
        store = SharedResponseStore(4, 60, path=path)
        running = entry("r", "in_progress")
        store.put(running)
        ready.put(os.getpid())
        await asyncio.wait_for(running.stop.wait(), timeout=30)
        store.put(running)
        return running.response.status

    result.put(asyncio.run(run()))


def test_a_cancel_reaches_a_response_another_process_runs(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite3")
    context = multiprocessing.get_context("spawn")
    ready, result = context.Queue(), context.Queue()
    process = context.Process(target=_run_until_cancelled, args=(path, ready, result))
    process.start()
    try:
        assert ready.get(timeout=60) == process.pid
        assert SharedResponseStore(4, 60, path=path).cancel("r").response.status == "cancelled"
        assert result.get(timeout=30) == "cancelled"
    finally:
        process.join(timeout=30)
    assert SharedResponseStore(4, 60, path=path).get("r").response.status == "cancelled"


def _first_uses(paths: list[str], barrier: multiprocessing.synchronize.Barrier, failures: multiprocessing.Queue) -> None:
    failed = []
    for path in paths:
        store = SharedResponseStore(4, 60, path=path)
        barrier.wait()
        try:
            store.get("r")
        except sqlite3.Error as e:
            failed.append(f"{path}: {e!r}")
    failures.put(failed)


def test_workers_first_using_a_new_file_at_once_all_wait_for_its_setup(tmp_path: Path) -> None:
    """The first requests on several workers at once each open the new file and switch it to WAL,
    which SQLite may answer with "database is locked" at once, without its busy timeout (a 500 in
    CI). Without the retry, 9 of 10 runs of this test failed (on the 2-core VM)."""
    paths = [str(tmp_path / f"r{i}.sqlite3") for i in range(300)]
    context = multiprocessing.get_context("spawn")
    barrier, failures = context.Barrier(6), context.Queue()
    processes = [context.Process(target=_first_uses, args=(paths, barrier, failures)) for _ in range(6)]
    for process in processes:
        process.start()
    try:
        failed = [f for _ in processes for f in failures.get(timeout=120)]
    finally:
        for process in processes:
            process.join(timeout=30)
    assert failed == []


def test_files_of_servers_that_are_gone_are_removed() -> None:
    gone = multiprocessing.get_context("spawn").Process(target=os.getpid)
    gone.start()
    gone.join()
    folder = private_folder()
    stale, live = folder / f"llgtrt-test-{gone.pid}.sqlite3", folder / f"llgtrt-test-{os.getpid()}.sqlite3"
    try:
        stale.touch()
        live.touch()
        remove_stale_server_files("llgtrt-test")
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
