"""Stored responses of the Responses API: in memory, per replica, bounded in count and age.

A response is stored when it starts (GET shows it in progress, cancel can stop it) and updated
when it ends. `previous_response_id` continues the conversation a stored response ends: its
input items, then its output as items. The oldest responses go first past `max_size`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

from llgtrt_core.api.responses_protocol import InputItem, ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    input_items: list[InputItem]  # the conversation before its output, previous responses' included
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set by cancel while in progress
    stored_at: float = field(default_factory=time.monotonic)


class ResponseStore:
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

    def _drop_expired(self) -> None:
        oldest_kept = self._clock() - self.ttl_s
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.stored_at >= oldest_kept:
                break
            self._entries.popitem(last=False)
