"""Stop strings that never reach the client, whole or in part.

Text is released only once it cannot be the start of a stop string: the longest suffix of the
pending text that is a prefix of some stop string stays held back until more text decides it.
"""

from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str], include_stop_string: bool = False):
        self._stops = [s for s in stop_strings if s]
        self._include_stop_string = include_stop_string
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text safe to emit now. Once a stop string is seen, `stopped` is set and the rest is dropped."""
        if self.stopped:
            return ""
        self._pending += text
        match = self._earliest_match()
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include_stop_string else start
            self.stopped = True
            released, self._pending = self._pending[:end], ""
            return released
        keep = self._held_back_length()
        released = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(released):]
        return released

    def flush(self) -> str:
        """At the end of generation without a stop string: release what was held back."""
        released, self._pending = ("" if self.stopped else self._pending), ""
        return released

    def _earliest_match(self) -> tuple[int, str] | None:
        # The match that ends first is the one a token-by-token scan meets first, so the outcome
        # does not depend on how the text was split into deltas.
        found = [(at, stop) for stop in self._stops if (at := self._pending.find(stop)) >= 0]
        return min(found, key=lambda m: (m[0] + len(m[1]), m[0])) if found else None

    def _held_back_length(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
