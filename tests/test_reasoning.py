"""The thinking section without a server: family detection from chat templates, the grammar (free
thinking, the budget forcing the end marker, then the answer's constraint) on the default model's
tokenizer, and the split of the output into thinking and answer, whole or streamed."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

from llgtrt_core.constraints.reasoning_grammar import reasoning_grammar
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.reasoning import (ReasoningSection, ReasoningSettings, detect_markers, prompt_state,
                                   resolve_reasoning)
from llgtrt_core.tools import HERMES, plan_tools, tool_grammar
from test_tool_grammar import _accepts, tokenizers  # noqa: F401 (a fixture)

QWEN3 = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
         "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
DEEPSEEK_R1 = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}{{ content.split('</think>')[-1] }}"
GPT_OSS = "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}"
SMOLLM2 = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}{% endfor %}"
SETTINGS = ReasoningSettings("<think>", "</think>", 64, 1024)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("template,markers", [
    (QWEN3, ("<think>", "</think>")),
    (DEEPSEEK_R1, ("<think>", "</think>")),
    (GPT_OSS, ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")),
    (SMOLLM2, None),
    (None, None),
])
def test_family_detection(template, markers) -> None:
    assert detect_markers(template) == markers


def test_configured_markers_override_and_enable() -> None:
    assert resolve_reasoning(SMOLLM2, None, None, None, 64, 1024) is None
    assert resolve_reasoning(SMOLLM2, None, "[T]", "[/T]", 64, 1024) == ReasoningSettings("[T]", "[/T]", 64, 1024)
    assert resolve_reasoning(QWEN3, False, None, None, 64, 1024) is None
    assert resolve_reasoning(QWEN3, None, None, "</thinking>", 8, 16).end == "</thinking>"
    with pytest.raises(ValueError, match="markers"):
        resolve_reasoning(SMOLLM2, True, None, None, 64, 1024)


def test_prompt_state_from_the_rendered_prompt() -> None:
    assert prompt_state(SETTINGS, "<|im_start|>assistant\n") is False  # the output opens the section
    assert prompt_state(SETTINGS, "<｜Assistant｜><think>\n") is True  # the template opened it
    assert prompt_state(SETTINGS, "assistant\n<think>\n\n</think>\n\n") is None  # enable_thinking: false


def _consume(tokenizers, grammar: str, text: str) -> LLMatcher:
    hf, ll_tokenizer = tokenizers
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    assert all(matcher.consume_token(t) for t in hf.encode(text, add_special_tokens=False))
    return matcher


def test_json_answer_after_free_thinking(tokenizers) -> None:
    grammar = reasoning_grammar("<think>", "</think>", 64, json_schema_grammar(SCHEMA), {})
    assert _accepts(tokenizers, grammar, '<think>Let me see. {"a": "b"} is not it.</think>{"a":1}')
    assert _accepts(tokenizers, grammar, '<think>x</think>\n\n{"a":1}')
    assert not _accepts(tokenizers, grammar, '<think>x</think>Sure: {"a":1}')
    assert not _accepts(tokenizers, grammar, '<think>x</think>{"a":"one"}')
    assert not _accepts(tokenizers, grammar, '{"a":1}')  # the section must come first


def test_the_section_opened_by_the_prompt(tokenizers) -> None:
    grammar = reasoning_grammar(None, "</think>", 64, json_schema_grammar(SCHEMA), {})
    assert _accepts(tokenizers, grammar, 'hmm</think>{"a":2}')
    assert not _accepts(tokenizers, grammar, '<think>hmm</think></think>{"a":2}')


def test_the_budget_forces_the_end_marker(tokenizers) -> None:
    hf, _ = tokenizers
    grammar = reasoning_grammar("<think>", "</think>", 5, json_schema_grammar(SCHEMA), {})
    matcher = _consume(tokenizers, grammar, "<think>a b c d e")  # 5 thinking tokens
    assert hf.decode(matcher.compute_ff_tokens()) == "</think>"
    assert not _accepts(tokenizers, grammar, '<think>a b c d e f g</think>{"a":1}')
    assert _accepts(tokenizers, grammar, '<think>a b c d e</think>{"a":1}')


def test_free_text_answer_and_tools(tokenizers) -> None:
    free = reasoning_grammar("<think>", "</think>", 64, None, {})
    assert _accepts(tokenizers, free, "<think>hm</think>Paris, of course.")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tools = tool_grammar(plan_tools({"tools": [weather], "tool_choice": "required"}, HERMES), {})
    grammar = reasoning_grammar("<think>", "</think>", 64, tools, {})
    call = HERMES.render_calls([("get_weather", '{"city": "Paris"}')])
    assert _accepts(tokenizers, grammar, f"<think>The user wants weather.</think>{call}")
    assert not _accepts(tokenizers, grammar, "<think>The user wants weather.</think>It is sunny.")


def _streamed(section: ReasoningSection, text: str, size: int) -> tuple[str, str]:
    splitter = section.splitter()
    pieces = [splitter.feed(text[i:i + size]) for i in range(0, len(text), size)] + [splitter.feed("", True)]
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_split_streamed_as_whole(size) -> None:
    section = ReasoningSection(SETTINGS, opened_by_prompt=False, budget=64)
    text = '<think>x < y, so </th is not it</think>\n\n{"a":1}\n'
    assert _streamed(section, text, size) == ("x < y, so </th is not it", '{"a":1}\n')
    assert section.splitter().split(text) == ("x < y, so </th is not it", '{"a":1}\n')
    opened = ReasoningSection(SETTINGS, opened_by_prompt=True, budget=64)
    assert _streamed(opened, "\nhm</think>ok", size) == ("\nhm", "ok")
    assert _streamed(section, "<think>cut by max_tokens </thi", size) == ("cut by max_tokens </thi", "")


def test_config_bounds() -> None:
    from llgtrt_core.config import Config, ConfigError

    assert Config.from_mapping({"reasoning": {"start": "<t>", "end": "</t>"}}).reasoning.end == "</t>"
    with pytest.raises(ConfigError, match="reasoning"):
        Config.from_mapping({"reasoning": {"end": ""}})
    with pytest.raises(ConfigError, match="default_max_reasoning_tokens"):
        Config.from_mapping({"reasoning": {"default_max_reasoning_tokens": 10, "max_reasoning_tokens_limit": 5}})
