"""The grammar of an answer after a thinking section: free text up to the end marker, at most
`budget` tokens of it (then the end marker is forced), then the request's own constraint.

With a plain-string end marker the text is a `stop` lexeme: it ends lazily where the marker first
appears, and the marker is matched again by the rule after it (no backtracking), so the model writes it
once. With a marker that is an added token (which text cannot hold) the text is greedy free text.
When the budget runs out mid-text, `max_tokens` ends the text and only the end marker may follow.
"""

from __future__ import annotations

import json
from typing import Mapping, Optional

from llgtrt_core.constraints.lark_parts import literal, named_subgrammars

_ANSWER = "reasoning_answer"
_FREE_TEXT = "/(.|\\n)*/"


def reasoning_grammar(start: Optional[str], end: str, budget: int, answer: Optional[str],
                      added_tokens: Mapping[str, int]) -> str:
    """llguidance JSON: `start` (None: the prompt opened the section), the thinking, `end`, up to two
    newlines, then `answer` (a grammar's text; None: free text)."""
    end_lark = literal(end, added_tokens)
    if end_lark.startswith('"'):  # no added token in it: the text stops at the marker's first bytes
        text_rule = f"think_text[stop={json.dumps(end)}, max_tokens={budget}]: {_FREE_TEXT}"
    else:
        text_rule = f"think_text[max_tokens={budget}]: {_FREE_TEXT}"
    opening = f"{literal(start, added_tokens)} " if start else ""
    tail = f"@{_ANSWER}" if answer is not None else "ANSWER_TEXT"
    rules = [f"start: {opening}think_text {end_lark} (\"\\n\" | \"\\n\\n\")? {tail}", text_rule]
    if answer is None:
        rules.append(f"ANSWER_TEXT: {_FREE_TEXT}")
    lark = "%llguidance {}\n" + "\n".join(rules) + "\n"
    subgrammars = named_subgrammars(answer, _ANSWER) if answer is not None else []
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *subgrammars]})
