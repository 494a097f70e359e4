"""Unit tests of the text path: tokenizer wrapper, chat template sandbox, incremental
detokenizer and stop-string hold-back, on the default model's real tokenizer."""

from __future__ import annotations

import itertools
import random

import pytest

from llgtrt_core.chat_template import ChatTemplate, ChatTemplateError
from llgtrt_core.detokenizer import IncrementalDetokenizer
from llgtrt_core.stop_strings import StopStringMatcher
from llgtrt_core.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "héllo wörld, ça va? naïve café",
    "世界你好，今天天气很好。",
    "emoji: 🎉🚀 👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "mixed: Ω≈ç√∫ 한국어 العربية עברית",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir) -> Tokenizer:
    return Tokenizer(smollm2_tokenizer_dir)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_basics(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == {tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]}
    ids = tokenizer.encode("The capital of France is Paris.")
    assert tokenizer.decode(ids) == "The capital of France is Paris."
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"


def test_chat_template_matches_transformers(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = tokenizer.chat_template.render(messages, add_generation_prompt=True)
    theirs = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")


def test_continue_final_message_cuts_end_of_turn(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = tokenizer.chat_template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2,")


# --------------------------------------------------------------------------- sandbox


def test_template_cannot_reach_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_template_cannot_mutate_inputs() -> None:
    template = ChatTemplate("{% set _ = messages.append(1) %}{{ messages|length }}", {})
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_template_helpers() -> None:
    source = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}{{ messages[0]['content'] | tojson }}|{{ strftime_now('%Y') | length }}"
        "{% generation %}!{% endgeneration %}"
    )
    template = ChatTemplate(source, {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "né <b>"}]) == '<s>"né <b>"|4!'
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        template.render([{"role": "system", "content": "x"}])


# --------------------------------------------------------------------------- detokenizer


def _stream(tokenizer: Tokenizer, prompt: list[int], token_ids: list[int], chunk_sizes: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces, start = [], 0
    for size in itertools.cycle(chunk_sizes):
        if start >= len(token_ids):
            break
        pieces.append(detokenizer.add(token_ids[start:start + size]))
        start += size
    pieces.append(detokenizer.flush())
    return pieces


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_detokenizer_never_splits_a_character(tokenizer: Tokenizer, text: str) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # The test means something only if single tokens carry partial characters.
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    for chunk_sizes in ([1], [2], [3, 1], [len(token_ids)]):
        pieces = _stream(tokenizer, prompt, token_ids, chunk_sizes)
        assert all("\ufffd" not in piece for piece in pieces), pieces
        assert "".join(pieces) == text


def test_detokenizer_random_chunks_rebuild_text(tokenizer: Tokenizer) -> None:
    text = " ".join(MULTIBYTE_TEXTS)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 4) for _ in range(8)]
        assert "".join(_stream(tokenizer, [], token_ids, sizes)) == text


def test_detokenizer_flush_releases_incomplete_character(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    streamed = detokenizer.add(token_ids[:-1])  # the emoji's last byte is missing
    assert "\ufffd" not in streamed
    rest = detokenizer.flush()
    assert rest.endswith("\ufffd")
    assert streamed + rest == tokenizer.decode(token_ids[:-1])


def test_detokenizer_skip_special_tokens(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join(_stream(tokenizer, [], token_ids, [1])) == "Hi"
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert keep.add(token_ids) + keep.flush() == "Hi<|im_end|>"


# --------------------------------------------------------------------------- stop strings


def _feed_all(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    released = [matcher.feed(piece) for piece in pieces]
    released.append(matcher.flush())
    return released


def test_stop_string_prefix_is_held_back() -> None:
    matcher = StopStringMatcher(["world!"])
    assert matcher.feed("Hello wor") == "Hello "
    assert matcher.feed("ld") == ""
    assert matcher.feed("! and more") == ""
    assert matcher.stopped
    assert matcher.flush() == ""


def test_false_alarm_is_released() -> None:
    matcher = StopStringMatcher(["world!"])
    assert matcher.feed("Hello wor") == "Hello "
    assert matcher.feed("k") == "work"
    assert not matcher.stopped
    assert matcher.feed(" worl") == " "
    assert matcher.flush() == "worl"


@pytest.mark.parametrize("stops, text, expected", [
    (["STOP"], "abc STOP def", "abc "),
    (["\n\n", "END"], "line\nline\n\nEND", "line\nline"),
    (["xyz", "y"], "axyz", "ax"),  # "y" completes first
    (["ab", "abc"], "zabc", "z"),
    (["世界"], "你好世界!", "你好"),
    (["not there"], "nothing stops this", "nothing stops this"),
])
def test_stop_strings_absent_from_every_split(stops: list[str], text: str, expected: str) -> None:
    for cut_a, cut_b in itertools.combinations(range(len(text) + 1), 2):
        pieces = [text[:cut_a], text[cut_a:cut_b], text[cut_b:]]
        released = _feed_all(StopStringMatcher(stops), pieces)
        assert "".join(released) == expected, pieces
        for piece in released:
            assert not any(stop in piece for stop in stops)


def test_include_stop_string() -> None:
    matcher = StopStringMatcher(["</answer>"], include_stop_string=True)
    released = _feed_all(matcher, ["42</ans", "wer> trailing"])
    assert "".join(released) == "42</answer>"
