"""How each model family writes tool calls, and which family a chat template belongs to.

Every family writes a run of calls as `trigger open CALL (item_separator CALL)* close`, each CALL a
JSON object `{"name": ..., "<arguments_key>": {...}}`; Hermes-style families write one call per
block and repeat the block. The same description drives the streaming parser, the grammar that
constrains generation, and the rendering of past calls for templates that cannot render them.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # starts a run of calls inside free text
    open: str  # between the trigger and the first call
    close: str  # after the last call of a run
    item_separator: Optional[str]  # between calls of one run; None: one call per run
    block_separator: str = ""  # between runs, when each run holds one call
    arguments_key: str = "arguments"
    bare_json_start: bool = False  # an output starting with `{` is a run of calls too (Llama 3)
    native: bool = True  # the template renders `tools`, assistant `tool_calls` and `tool` messages
    short_call_ids: bool = False  # Mistral's templates accept only 9-character call ids

    def new_call_id(self) -> str:
        if self.short_call_ids:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Past (name, arguments JSON) calls as the model would have written them (a bare-JSON
        family answering with calls only writes no trigger)."""
        objects = [f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.arguments_key}": {arguments or "{}"}}}'
                   for name, arguments in calls]
        if self.item_separator is None:
            return self.block_separator.join(f"{self.trigger}{self.open}{o}{self.close}" for o in objects)
        trigger = "" if self.bare_json_start else self.trigger
        return f"{trigger}{self.open}{self.item_separator.join(objects)}{self.close}"


HERMES = ToolFormat("hermes", trigger="<tool_call>", open="\n", close="\n</tool_call>", item_separator=None,
                    block_separator="\n")
LLAMA3_JSON = ToolFormat("llama3_json", trigger="<|python_tag|>", open="", close="", item_separator="; ",
                         arguments_key="parameters", bare_json_start=True)
MISTRAL = ToolFormat("mistral", trigger="[TOOL_CALLS]", open="[", close="]", item_separator=", ",
                     short_call_ids=True)
# Templates with no tool support: tools are described in the system message and the model
# answers in Hermes markup, plain text to a tokenizer that has no such special tokens.
GENERIC_JSON = ToolFormat("generic_json", trigger="<tool_call>", open="\n", close="\n</tool_call>",
                          item_separator=None, block_separator="\n", native=False)

TOOL_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, GENERIC_JSON)}


def detect_tool_format(template_source: Optional[str], configured: Optional[str] = None) -> ToolFormat:
    """The family a chat template was written for (GENERIC_JSON when it knows no tools), unless
    the config names one (`tokenizer.tool_format`, a key of TOOL_FORMATS). Resolve it once per model."""
    if configured is not None:
        return TOOL_FORMATS[configured]
    source = template_source or ""
    if "<tool_call>" in source:
        return HERMES
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "tools" in source):
        return LLAMA3_JSON
    return GENERIC_JSON
