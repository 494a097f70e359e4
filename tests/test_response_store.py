"""The response store's bounds: the oldest responses go first past its size, and each expires after
its time-to-live (a fake clock; no server needed)."""

from __future__ import annotations

from llgtrt_core.api.response_store import ResponseStore, StoredResponse
from llgtrt_core.api.responses_protocol import ResponseObject


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(response_id: str) -> StoredResponse:
    return StoredResponse(ResponseObject(id=response_id, model="m"), input_items=[])


def test_the_oldest_go_first_past_the_size() -> None:
    store = ResponseStore(max_size=2, ttl_s=60, clock=Clock())
    for response_id in ("a", "b", "c"):
        store.put(entry(response_id))
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None


def test_storing_again_refreshes_age_and_order() -> None:
    clock = Clock()
    store = ResponseStore(max_size=2, ttl_s=10, clock=clock)
    a, b = entry("a"), entry("b")
    store.put(a)
    store.put(b)
    clock.now = 5
    store.put(a)  # a response that ended is stored again: it is now the newest
    store.put(entry("c"))
    assert store.get("b") is None and store.get("a") is a
    clock.now = 14.9
    assert store.get("a") is a
    clock.now = 15.1
    assert store.get("a") is None and store.get("c") is None


def test_size_zero_stores_nothing_and_delete_says_whether_it_held_one() -> None:
    empty = ResponseStore(max_size=0, ttl_s=60)
    empty.put(entry("a"))
    assert empty.get("a") is None and not empty.delete("a")
    store = ResponseStore(max_size=1, ttl_s=60)
    store.put(entry("a"))
    assert store.delete("a") and not store.delete("a")
