"""Stored responses of the Responses API, bounded in count and age: the interface, and the store of
a server with one API worker (in memory). Several workers share one over SQLite
(response_store_shared.py).

A response is stored when it starts (GET shows it in progress, cancel can stop it) and again when
it ends. `previous_response_id` continues the conversation a stored response ends: its input
items, then its output as items. The oldest responses go first past `max_size`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from llgtrt_core.api.responses_protocol import InputItem, ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    input_items: list[InputItem]  # the conversation before its output, previous responses' included
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set by cancel while in progress
    stored_at: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.response.status = "cancelled"
        self.stop.set()  # its generation ends at its next token


class ResponseStore(Protocol):
    def put(self, entry: StoredResponse) -> None:
        """Store `entry` (again), as the newest. A response cancelled meanwhile keeps its cancel
        (status "cancelled", `entry.stop` set)."""
        ...

    def get(self, response_id: str) -> Optional[StoredResponse]:
        ...

    def delete(self, response_id: str) -> bool:
        """Whether it held the response."""
        ...

    def cancel(self, response_id: str) -> Optional[StoredResponse]:
        """The response; one in progress is now "cancelled" and its generation told to stop."""
        ...


class MemoryResponseStore:
    """The responses of one API worker, in its memory: entries are the live objects their
    requests update."""

    def __init__(self, max_size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        entry.stored_at = self._clock()
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        self._drop_expired()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._drop_expired()
        return self._entries.pop(response_id, None) is not None

    def cancel(self, response_id: str) -> Optional[StoredResponse]:
        entry = self.get(response_id)
        if entry is not None and entry.response.status == "in_progress":
            entry.cancel()
        return entry

    def _drop_expired(self) -> None:
        oldest_kept = self._clock() - self.ttl_s
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.stored_at >= oldest_kept:
                break
            self._entries.popitem(last=False)
