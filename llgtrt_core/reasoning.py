"""Reasoning models: the markers around their thinking section, found per model, and the split of
their output into the thinking and the answer (docs/reasoning.md).

The markers are plain strings (an added token such as Qwen3's `</think>` is its text). Whether the
chat template opened the section itself (DeepSeek-R1's template ends the prompt with `<think>\\n`)
or closed it (Qwen3's with `enable_thinking: false`) is read off each prompt's end, so one setting
serves both template variants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Known families, by a string only their chat templates hold: (start, end) markers.
_FAMILIES = (
    ("<|channel|>analysis", ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")),
    ("</think>", ("<think>", "</think>")),  # Qwen3, QwQ, DeepSeek-R1 and its distills
)


@dataclass(frozen=True)
class ReasoningSettings:
    """A model's thinking section: its markers and the bounds of its budget (max_reasoning_tokens)."""

    start: str
    end: str
    default_budget: int  # thinking tokens when the request names none
    max_budget: int  # the largest budget a request may ask for


def detect_markers(template_source: Optional[str]) -> Optional[tuple[str, str]]:
    """(start, end) markers of a known reasoning family's chat template; None when none is recognised."""
    if not template_source:
        return None
    for needle, markers in _FAMILIES:
        if needle in template_source:
            return markers
    return None


def resolve_reasoning(template_source: Optional[str], enabled: Optional[bool], start: Optional[str],
                      end: Optional[str], default_budget: int, max_budget: int) -> Optional[ReasoningSettings]:
    """The model's settings: the configured markers, else the template's family; None when the model has
    no thinking section (or the config turns it off)."""
    if enabled is False:
        return None
    detected = detect_markers(template_source)
    start = start if start is not None else (detected[0] if detected else None)
    end = end if end is not None else (detected[1] if detected else None)
    if start is None or end is None:
        if enabled:
            raise ValueError("reasoning is enabled but its markers are neither configured (reasoning.start, "
                             "reasoning.end) nor recognised in the chat template")
        return None
    return ReasoningSettings(start, end, default_budget, max_budget)


@dataclass(frozen=True)
class ReasoningSection:
    """One request's thinking section: the markers, whether the prompt already opened it, its budget."""

    settings: ReasoningSettings
    opened_by_prompt: bool
    budget: int

    def splitter(self) -> "ReasoningSplitter":
        return ReasoningSplitter(self)


def prompt_state(settings: ReasoningSettings, prompt_tail: str) -> Optional[bool]:
    """From the prompt's last characters: True when it opened the section, None when it already closed
    it (a template's `enable_thinking: false`), False when the output must open it."""
    tail = prompt_tail.rstrip()
    if tail.endswith(settings.end):
        return None
    return tail.endswith(settings.start.rstrip())


class ReasoningSplitter:
    """One choice's text -> (thinking, answer) pieces, streamed: the start marker is dropped, the end
    marker too and the newlines after it; a possible marker prefix is held back until decided."""

    def __init__(self, section: ReasoningSection):
        self._start = None if section.opened_by_prompt else section.settings.start
        self._end = section.settings.end
        self._pending = ""
        self.answering = False
        self._answer_started = False

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        if self.answering:
            return "", self._answer(text)
        self._pending += text
        if self._start is not None:
            if not finished and len(self._pending) < len(self._start) and self._start.startswith(self._pending):
                return "", ""
            self._pending = self._pending.removeprefix(self._start)
            self._start = None
        at = self._pending.find(self._end)
        if at >= 0:
            thinking, rest = self._pending[:at], self._pending[at + len(self._end):]
            self._pending, self.answering = "", True
            return thinking, self._answer(rest)
        keep = 0 if finished else _held_back(self._pending, self._end)
        thinking, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return thinking, ""

    def split(self, text: str) -> tuple[str, str]:
        """A whole output at once."""
        return self.feed(text, finished=True)

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip("\n")
            self._answer_started = bool(text)
        return text


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
