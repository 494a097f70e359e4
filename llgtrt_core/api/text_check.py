"""Finding text no tokenizer, regex engine or JSON encoder takes: a lone UTF-16 surrogate.

JSON may spell one (`"\\ud800"`) and Python's json module decodes it into a str that fails the
moment anything encodes it to UTF-8, deep inside a tokenizer or an error body: a 500. Request
bodies are checked once, as bytes (fast: a regex over the escapes), and only a body that has such
a lone one is decoded to name the field that holds it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

_HIGH = rb"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
# A high surrogate escape not followed by a low one, or a low one not preceded by a high one (an
# escaped backslash before `u` can match too: the decoded check below settles it).
_LONE_SURROGATE_ESCAPE = re.compile(_HIGH + b"(?!" + _LOW + b")|(?<!" + _HIGH + b")" + _LOW)
# Any surrogate escape, high or low. Its literal start makes this scan fast, so the pattern above, tried
# at every byte for its lookbehind, runs only on a body that has one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_param(body: bytes) -> Optional[str]:
    """None when the JSON body holds no lone surrogate; else the field holding one, like
    `messages[0].content` ("" for the top level, or for a body that is not JSON at all)."""
    if _SURROGATE_ESCAPE.search(body) is None or _LONE_SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: the app's own parsing says so
    return _first_lone_surrogate(data)


def has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _first_lone_surrogate(data: Any) -> Optional[str]:
    # Iterative: schemas nest deeper than Python's recursion limit allows.
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if has_lone_surrogate(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if has_lone_surrogate(key):
                    return path
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
    return None
