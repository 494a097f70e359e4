"""Streaming parser of a model's output into content and tool calls.

Fed text in pieces of any size, it yields events: content text, the start of a call (its name,
once), and fragments of the call's arguments whose concatenation is the arguments JSON exactly
as the model wrote it. Markup (triggers, separators, the JSON around the arguments) never
reaches the content. Whitespace is held back until the next visible character, so whitespace
around calls is dropped, and the same text gives the same content and calls however it is split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

from llgtrt_core.tools.formats import ToolFormat


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = Union[ContentDelta, CallStart, ArgumentsDelta]


def _no_space(text: str) -> str:
    return "".join(text.split())


class _CallObject:
    """One `{"name": ..., "<arguments key>": ...}` object, scanned a character at a time.

    Only the top-level keys are interpreted; the arguments value is kept verbatim (an object),
    or decoded when a model wrote it as a JSON string.
    """

    def __init__(self, arguments_keys: tuple[str, ...]):
        self.arguments_keys = arguments_keys
        self.raw: list[str] = []
        self.name: Optional[str] = None
        self.done = False
        self._key_chars: Optional[list[str]] = None  # a top-level key being read
        self._key: Optional[str] = None
        self._value: Optional[list[str]] = None  # a top-level value being read
        self._nesting = 0
        self._in_string = False
        self._escaped = False
        self._arguments: Optional[str] = None  # final arguments text, once its value ended
        self._streamed_arguments: Optional[list[str]] = None  # the arguments object as it comes

    def feed(self, ch: str) -> None:
        self.raw.append(ch)
        if len(self.raw) == 1:  # the opening brace
            return
        if self._value is not None:
            self._feed_value(ch)
        elif self._key_chars is not None:
            self._key_chars.append(ch)
            if self._string_ended(ch):
                self._key = _decode(self._key_chars)
                self._key_chars = None
        elif ch == '"':
            self._key_chars = [ch]
        elif ch == ":":
            self._value = []
            self._streamed_arguments = [] if self._key in self.arguments_keys else None
        elif ch == "}":
            self.done = True

    def _string_ended(self, ch: str) -> bool:
        """Tracks escapes inside a string that started with the previous quote."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            return True
        return False

    def _feed_value(self, ch: str) -> None:
        assert self._value is not None
        if not self._value and ch.isspace():
            return  # whitespace before the value
        if self._in_string:
            self._in_string = not self._string_ended(ch)
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._nesting += 1
        elif ch in "}]" and self._nesting > 0:
            self._nesting -= 1
        elif ch in ",}" and self._nesting == 0:
            self._end_value()
            self.done = ch == "}"
            return
        self._value.append(ch)
        if self._streamed_arguments is not None and self._value[0] in "{[":
            self._streamed_arguments.append(ch)

    def _end_value(self) -> None:
        assert self._value is not None
        text = "".join(self._value).rstrip()
        if self._key == "name":
            decoded = _decode(text)
            self.name = decoded if isinstance(decoded, str) else None
        elif self._key in self.arguments_keys:
            decoded = _decode(text) if text.startswith('"') else None
            self._arguments = decoded if isinstance(decoded, str) else text
        self._value = None
        self._streamed_arguments = None

    def arguments_since(self, start: int) -> str:
        """The arguments text known to be final (trailing whitespace held back) from character
        `start` on. Built from the new characters only: called for every character of a call,
        joining everything streamed so far made long arguments quadratic."""
        if self._arguments is not None:
            return self._arguments[start:]
        if self._streamed_arguments is not None:
            return "".join(self._streamed_arguments[start:]).rstrip()  # one character per entry
        return ""

    def final_arguments_since(self, start: int) -> str:
        """After the object ended, from character `start` on: a call without arguments takes none."""
        return (self._arguments if self._arguments else "{}")[start:]


def _decode(chars: Union[str, list[str]]) -> object:
    try:
        return json.loads("".join(chars))
    except json.JSONDecodeError:
        return None


class ToolCallParser:
    def __init__(self, tool_format: ToolFormat):
        self.format = tool_format
        self._arguments_keys = tuple(dict.fromkeys((tool_format.arguments_key, "arguments", "parameters")))
        self._state = "content"  # content | open | object | between
        self._held = ""  # content not yet emitted: trailing whitespace and a partial trigger
        self._seen_text = False  # a visible character was output (bare JSON must come first)
        self._run_raw: list[str] = []  # markup of the run of calls being read (content if it is not one)
        self._call: Optional[_CallObject] = None
        self._started = False  # CallStart sent for the current call
        self._emitted_arguments = 0
        self._between = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        for ch in text:
            self._feed_char(ch, events)
        return _coalesce(events)

    def finish(self) -> list[ToolEvent]:
        """The end of the output: flush held content; an unfinished call keeps what it has."""
        events: list[ToolEvent] = []
        if self._state == "content" and self.num_calls == 0:  # after calls, a partial trigger is markup
            self._emit_content(self._held.rstrip(), events)
        elif self._state == "object" and self._call is not None and self._call.name is not None:
            self._emit_arguments(self._call.arguments_since(self._emitted_arguments), events)
        self._state, self._held = "content", ""
        return _coalesce(events)

    # ------------------------------------------------------------------ states

    def _feed_char(self, ch: str, events: list[ToolEvent]) -> None:
        if self._state == "content":
            self._feed_content(ch, events)
        elif self._state == "open":
            self._run_raw.append(ch)
            if ch == "{":
                self._start_object()
            elif not ch.isspace() and ch not in self.format.open:
                self._abandon_run(events)
        elif self._state == "object":
            self._feed_object(ch, events)
        else:
            self._feed_between(ch, events)

    def _feed_content(self, ch: str, events: list[ToolEvent]) -> None:
        trigger = self.format.trigger
        if self.format.bare_json_start and not self._seen_text and ch == "{":
            self._held, self._run_raw = "", []
            self._start_object()
            return
        self._held += ch
        if self._held.endswith(trigger):
            self._run_raw = [self._held]
            self._held, self._state = "", "open"
            return
        # Keep a partial trigger and the whitespace before it; emit the rest.
        partial = next((k for k in range(min(len(trigger) - 1, len(self._held)), 0, -1)
                        if trigger.startswith(self._held[-k:])), 0)
        candidate = self._held[: len(self._held) - partial]
        visible = candidate.rstrip()
        if visible:
            self._emit_content(visible, events)
            self._held = self._held[len(visible):]

    def _start_object(self) -> None:
        self._call = _CallObject(self._arguments_keys)
        self._call.feed("{")
        self._started = False
        self._emitted_arguments = 0
        self._seen_text = True
        self._state = "object"

    def _feed_object(self, ch: str, events: list[ToolEvent]) -> None:
        call = self._call
        assert call is not None
        call.feed(ch)
        if call.name is not None:
            if not self._started:
                events.append(CallStart(self.num_calls, call.name))
                self._started = True
            emitted = self._emitted_arguments
            self._emit_arguments(call.final_arguments_since(emitted) if call.done else call.arguments_since(emitted),
                                 events)
        if call.done:
            if call.name is None:  # a JSON object, not a call: it was text after all
                self._run_raw.extend(call.raw)
                self._abandon_run(events)
                return
            self.num_calls += 1
            self._call, self._between, self._state = None, "", "between"

    def _emit_arguments(self, fragment: str, events: list[ToolEvent]) -> None:
        if fragment:
            events.append(ArgumentsDelta(self.num_calls, fragment))
            self._emitted_arguments += len(fragment)

    def _feed_between(self, ch: str, events: list[ToolEvent]) -> None:
        self._between += ch
        seen = _no_space(self._between)
        separator = _no_space(self.format.item_separator or "")
        close = _no_space(self.format.close)
        if separator and seen == separator:
            self._run_raw, self._state = [], "open"
        elif close and seen == close:
            self._state, self._held = "content", ""
        elif not ((separator and separator.startswith(seen)) or close.startswith(seen)):
            # The run ended without its closing markup: what follows is content again.
            rest, self._state, self._held = self._between.lstrip(), "content", ""
            for c in rest:
                self._feed_content(c, events)

    def _abandon_run(self, events: list[ToolEvent]) -> None:
        text = "".join(self._run_raw)
        visible = text.rstrip()
        self._state, self._held, self._run_raw, self._call = "content", text[len(visible):], [], None
        self._emit_content(visible, events)

    def _emit_content(self, text: str, events: list[ToolEvent]) -> None:
        if text:
            self._seen_text = True
            events.append(ContentDelta(text))


def _coalesce(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent content pieces, and adjacent fragments of one call, become one event."""
    merged: list[ToolEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == event.index:
            merged[-1] = ArgumentsDelta(event.index, last.text + event.text)
        else:
            merged.append(event)
    return merged
