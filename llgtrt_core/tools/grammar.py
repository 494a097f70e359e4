"""The llguidance grammar of a request with tools, in its model family's call format.

- required: one call or more (one when parallel calls are off), nothing else; bare-JSON
  families (Llama 3) write the calls without their trigger, as their templates do;
- named: exactly one call of that tool;
- auto: free text, or, once the model writes the trigger, calls only (a lazy lexeme ends the
  text at the trigger, as llguidance's StructTag does). With a `response_format`, the answer
  must match it instead of being free text.

Each call's arguments are constrained by its tool's JSON schema, strict or not, in the JSON
style chat templates render (`{"a": 1, "b": [2, 3]}`, no other whitespace).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from llgtrt_core.constraints.lark_parts import literal, named_subgrammars
from llgtrt_core.constraints.request_grammar import with_json_options
from llgtrt_core.tools.formats import ToolFormat
from llgtrt_core.tools.spec import ToolPlan, ToolSpec

ARGUMENTS_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANSWER = "tool_answer"
_FREE_TEXT = "TOOL_FREE_TEXT: /(.|\\n)*/"
_FREE_TEXT_NO_BRACE = "TOOL_FREE_TEXT: /([^{](.|\\n)*)?/"  # bare-JSON families: `{` starts a call


def arguments_grammar(tool: ToolSpec) -> dict[str, Any]:
    """The tool's arguments schema as an llguidance sub-grammar (the caller names it)."""
    return {"json_schema": with_json_options(tool.parameters, ARGUMENTS_JSON_STYLE)}


def tool_grammar(plan: ToolPlan, added_tokens: Mapping[str, int], answer_grammar: Optional[str] = None) -> str:
    """The whole grammar (llguidance JSON); `answer_grammar` constrains a non-call answer (auto)."""
    fmt = plan.format
    tools = plan.callable_tools
    subgrammars = []
    calls = []
    for i, tool in enumerate(tools):
        name = f"tool_arguments_{i}"
        subgrammars.append({"name": name, **arguments_grammar(tool)})
        head = literal(f'{{"name": {json.dumps(tool.name)}, "{fmt.arguments_key}": ', added_tokens)
        calls.append(f"{head} @{name} \"}}\"")
    rules = [f"tool_call: {' | '.join(calls)}", *_run_rules(fmt, plan.parallel, added_tokens)]
    trigger = literal(fmt.trigger, added_tokens)
    if plan.mode in ("required", "named"):
        rules.insert(0, "start: tool_runs" if fmt.bare_json_start else f"start: {trigger} tool_runs")
    elif answer_grammar is not None:
        rules.insert(0, f"start: @{_ANSWER} | {trigger} tool_runs")
        subgrammars.extend(named_subgrammars(answer_grammar, _ANSWER))
    else:
        rules[:0] = _auto_start(fmt, trigger)
    lark = "%llguidance {}\n" + "\n".join(rules) + "\n"
    return json.dumps({"grammars": [{"name": "tool_calls", "lark_grammar": lark}, *subgrammars]})


def _run_rules(fmt: ToolFormat, parallel: bool, added_tokens: Mapping[str, int]) -> list[str]:
    """`tool_runs`: what follows the first trigger (the opening markup, calls, closing markup)."""
    open_, close = literal(fmt.open, added_tokens), literal(fmt.close, added_tokens)
    if fmt.item_separator is None:  # one call per run; runs repeat
        run = f"{open_} tool_call {close}"
        if not parallel:
            return [f"tool_runs: {run}"]
        again = literal(fmt.block_separator + fmt.trigger, added_tokens)
        return [f"tool_runs: {run} ({again} {open_} tool_call {close})*"]
    separator = literal(fmt.item_separator, added_tokens)
    items = f"tool_call ({separator} tool_call)*" if parallel else "tool_call"
    return [f"tool_runs: {open_} {items} {close}"]


def _auto_start(fmt: ToolFormat, trigger: str) -> list[str]:
    if trigger.startswith("<["):  # a special token cannot hide inside the text: no lazy lexeme needed
        head = f"TOOL_FREE_TEXT {trigger}"
        rules = [f"start: TOOL_FREE_TEXT | {head} tool_runs"]
    else:
        rules = ["start: TOOL_FREE_TEXT | tool_trigger tool_runs",
                 f"tool_trigger[lazy]: TOOL_FREE_TEXT {trigger}"]
    if fmt.bare_json_start:  # the output may open with the first call's `{` (no trigger)
        rules[0] += " | tool_runs"
        rules.append(_FREE_TEXT_NO_BRACE)
    else:
        rules.append(_FREE_TEXT)
    return rules
