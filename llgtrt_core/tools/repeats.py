"""End a choice where the model starts repeating a tool call it already made.

A small model asked for calls (`tool_choice: "required"`) often writes the same call again and
again until max_tokens. The text goes through a tool-call parser of its own; each call after
the first is held back until it is complete, then released when it is new, or, when it repeats
an earlier call (same name, same arguments as JSON), cut off with everything after it: the choice
ends there, with the calls made so far (finish_reason `tool_calls`).
"""

from __future__ import annotations

import json
from typing import Any

from llgtrt_core.tools.formats import ToolFormat
from llgtrt_core.tools.parser import ArgumentsDelta, CallStart, ToolCallParser


class RepeatedCallStop:
    """Same use as `StopStringMatcher`: `feed` text, get the text to emit; `stopped` once a call repeats."""

    def __init__(self, tool_format: ToolFormat) -> None:
        self._parser = ToolCallParser(tool_format)
        self._text = ""  # everything fed
        self._released = 0  # text[:_released] was emitted
        self._kept = 0  # text[:_kept] may be emitted: up to the end of the last new call
        self._calls: set[tuple[str, Any]] = set()
        self._name = ""
        self._arguments: list[str] = []
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        for ch in text:
            self._text += ch
            calls = self._parser.num_calls
            for event in self._parser.feed(ch):
                if isinstance(event, CallStart):
                    self._name, self._arguments = event.name, []
                elif isinstance(event, ArgumentsDelta):
                    self._arguments.append(event.text)
            if self._parser.num_calls > calls and self._call_ended():
                break
        return self._release(self._text if not self._calls else self._text[:self._kept])

    def flush(self) -> str:
        """The end of the output: whatever is held back (an unfinished call) goes out."""
        return "" if self.stopped else self._release(self._text)

    def _call_ended(self) -> bool:
        """Keep the call that just ended when it is new; True when it repeats one (stop)."""
        call = (self._name, _normalized("".join(self._arguments)))
        if call in self._calls:
            self.stopped = True
            return True
        self._calls.add(call)
        self._kept = len(self._text)
        return False

    def _release(self, upto: str) -> str:
        text = upto[self._released:]
        self._released = len(upto)
        return text


def _normalized(arguments: str) -> Any:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except json.JSONDecodeError:
        return arguments
