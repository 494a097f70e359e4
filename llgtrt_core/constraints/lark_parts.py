"""Pieces of llguidance grammars that embed others (tool calls, a thinking section before the answer)."""

from __future__ import annotations

import json
from typing import Any, Mapping


def literal(text: str, added_tokens: Mapping[str, int]) -> str:
    """Lark for `text`, with the tokenizer's added tokens (`<tool_call>`, ...) as token references."""
    if not text:
        return ""
    for token, token_id in sorted(added_tokens.items(), key=lambda item: -len(item[0])):
        at = text.find(token)
        if token and at >= 0:
            parts = [literal(text[:at], added_tokens), f"<[{token_id}]>",
                     literal(text[at + len(token):], added_tokens)]
            return " ".join(p for p in parts if p)
    return json.dumps(text)


def named_subgrammars(grammar: str, name: str) -> list[dict[str, Any]]:
    """Another grammar (llguidance JSON or Lark text) as sub-grammars, its top one called `name`."""
    if not grammar.lstrip().startswith("{"):
        return [{"name": name, "lark_grammar": grammar}]
    grammars = [{k: v for k, v in g.items() if v is not None} for g in json.loads(grammar)["grammars"]]
    grammars[0]["name"] = name
    return grammars
