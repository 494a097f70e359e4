"""Tool grammars for every family and tool_choice, checked with llguidance on the default
model's tokenizer: what they accept, and what they refuse once a call has started; their
compiles go through the compiler's cache and a failure names the tool at fault."""

from __future__ import annotations

import asyncio
import json

import llguidance.hf
import pytest
from llguidance import LLMatcher
from prometheus_client import REGISTRY

from llgtrt_core.api.tool_calls import compile_tool_grammar
from llgtrt_core.constraints import GrammarCompiler, GrammarRequestError, request_grammar
from llgtrt_core.tools import (GENERIC_JSON, HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, arguments_grammar, plan_tools,
                               tool_grammar)
from llgtrt_core.tools.grammar import ARGUMENTS_JSON_STYLE
from llgtrt_core.constraints.lark_parts import literal

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
FORMATS = [GENERIC_JSON, HERMES, MISTRAL, LLAMA3_JSON]


@pytest.fixture(scope="module")
def tokenizers(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    return hf, llguidance.hf.from_tokenizer(hf)


def _accepts(tokenizers, grammar: str, text: str) -> bool:
    """True when the grammar takes `text` whole and may stop there."""
    hf, ll_tokenizer = tokenizers
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in hf.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def _grammar(fmt: ToolFormat, **request) -> str:
    return tool_grammar(plan_tools({"tools": [WEATHER, NOW], **request}, fmt), {})


PARIS = ("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_required(tokenizers, fmt: ToolFormat) -> None:
    grammar = _grammar(fmt, tool_choice="required")
    assert _accepts(tokenizers, grammar, fmt.render_calls([PARIS]))
    assert _accepts(tokenizers, grammar, fmt.render_calls([PARIS, ("now", "{}")]))
    assert not _accepts(tokenizers, grammar, "Hello")
    assert not _accepts(tokenizers, grammar, fmt.render_calls([("get_weather", '{"town": "Paris"}')]))
    assert not _accepts(tokenizers, grammar, fmt.render_calls([("other", "{}")]))
    assert not _accepts(tokenizers, grammar, fmt.render_calls([("now", '{"x": 1}')]))  # no parameters: {}
    single = _grammar(fmt, tool_choice="required", parallel_tool_calls=False)
    assert _accepts(tokenizers, single, fmt.render_calls([PARIS]))
    assert not _accepts(tokenizers, single, fmt.render_calls([PARIS, ("now", "{}")]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_named(tokenizers, fmt: ToolFormat) -> None:
    grammar = _grammar(fmt, tool_choice={"type": "function", "function": {"name": "now"}})
    assert _accepts(tokenizers, grammar, fmt.render_calls([("now", "{}")]))
    assert not _accepts(tokenizers, grammar, fmt.render_calls([PARIS]))
    assert not _accepts(tokenizers, grammar, fmt.render_calls([("now", "{}"), ("now", "{}")]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_auto_allows_text_and_constrains_a_started_call(tokenizers, fmt: ToolFormat) -> None:
    grammar = _grammar(fmt)
    after_text = "Let me check. " + (fmt.trigger if fmt.bare_json_start else "")
    assert _accepts(tokenizers, grammar, "Paris is sunny, {often}.")
    assert _accepts(tokenizers, grammar, fmt.render_calls([PARIS]))
    assert _accepts(tokenizers, grammar, after_text + fmt.render_calls([PARIS]))
    assert not _accepts(tokenizers, grammar, after_text + fmt.render_calls([("get_weather", '{"city": 3}')]))
    assert not _accepts(tokenizers, grammar, f"Let me check. {fmt.trigger} and some text")


def test_auto_with_response_format_answers_in_that_format(tokenizers) -> None:
    answer = request_grammar({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}})
    grammar = tool_grammar(plan_tools({"tools": [WEATHER]}, HERMES), {}, answer.grammar)
    assert _accepts(tokenizers, grammar, '{"a":1}')
    assert _accepts(tokenizers, grammar, HERMES.render_calls([PARIS]))
    assert not _accepts(tokenizers, grammar, "free text")


def test_added_tokens_become_token_references() -> None:
    assert literal("\n</tool_call>", {"</tool_call>": 8, "<tool_call>": 7}) == '"\\n" <[8]>'
    assert literal("[TOOL_CALLS][", {"[TOOL_CALLS]": 5}) == '<[5]> "["'
    assert literal("plain", {"<tool_call>": 7}) == '"plain"'
    grammar = json.loads(tool_grammar(plan_tools({"tools": [WEATHER], "tool_choice": "required"}, HERMES),
                                      {"<tool_call>": 7, "</tool_call>": 8}))
    assert "start: <[7]> tool_runs" in grammar["grammars"][0]["lark_grammar"]


def _compiles() -> float:
    """Grammars compiled so far (cache misses), as the metrics count them."""
    return REGISTRY.get_sample_value("llgtrt:grammar_compile_seconds_count") or 0.0


def test_a_repeated_tool_list_compiles_once(tokenizers) -> None:
    compiler = GrammarCompiler(tokenizers[1])
    before = _compiles()
    for _ in range(3):  # each request plans its tools and writes its grammar anew
        plan = plan_tools({"tools": [WEATHER, NOW]}, HERMES)
        asyncio.run(compile_tool_grammar(compiler, plan, tool_grammar(plan, {})))
    assert _compiles() - before == 1


def test_a_failing_tool_grammar_names_the_tool_at_fault(tokenizers) -> None:
    bad = {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}
    plan = plan_tools({"tools": [WEATHER, bad]}, HERMES)
    with pytest.raises(GrammarRequestError) as caught:
        asyncio.run(compile_tool_grammar(GrammarCompiler(tokenizers[1]), plan, tool_grammar(plan, {})))
    assert caught.value.param == "tools[1].function.parameters" and "no-such-type" in caught.value.message


@pytest.mark.parametrize("own", [None, {"key_separator": ":", "whitespace_flexible": True}])
def test_arguments_grammar_merges_json_options_as_llguidance_would(own):
    """The arguments' JSON style merged here, not by llguidance's `grammar_from_json_schema`."""
    parameters = dict(WEATHER["function"]["parameters"], **({} if own is None else {"x-guidance": own}))
    (tool,) = plan_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]},
                         HERMES).callable_tools
    theirs = json.loads(LLMatcher.grammar_from_json_schema(parameters, defaults=ARGUMENTS_JSON_STYLE))
    assert arguments_grammar(tool) == {"json_schema": theirs["grammars"][0]["json_schema"]}
