"""/v1/chat/completions against a real `bentoml serve`, through the official openai client."""

from __future__ import annotations

import pytest

from llgtrt_core.api.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from llgtrt_core.api.streaming import TEXT_PLACEHOLDER, TextEvents, sse_event
from llgtrt_core.tokenizer import Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


@pytest.fixture(scope="module")
def stored_tokenizer(stored_model_dir) -> Tokenizer:
    return Tokenizer(stored_model_dir)


def _stream(client, **kwargs):
    return list(client.chat.completions.create(stream=True, **kwargs))


def _content_deltas(chunks) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def test_models_lists_the_served_model(openai_client, served_model) -> None:
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [served_model]
    assert models.data[0].object == "model"


def test_greedy_answer_streamed_equals_non_streamed(openai_client, served_model) -> None:
    args = dict(model=served_model, messages=QUESTION, temperature=0, max_tokens=24)
    whole = openai_client.chat.completions.create(**args)
    assert whole.object == "chat.completion"
    assert whole.model == served_model
    assert "Paris" in whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    chunks = _stream(openai_client, **args)
    assert "".join(_content_deltas(chunks)) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stream_shape(openai_client, served_model) -> None:
    chunks = _stream(openai_client, model=served_model, messages=STORY, temperature=0, max_tokens=12)
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == served_model for c in chunks)
    roles = [c.choices[0].delta.role for c in chunks if c.choices[0].delta.role is not None]
    assert roles == ["assistant"]
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks]
    assert finish[-1] == "length"
    assert all(f is None for f in finish[:-1])
    assert all(c.usage is None for c in chunks)


def test_usage_matches_tokenizer(openai_client, served_model, stored_tokenizer) -> None:
    prompt = stored_tokenizer.chat_template.render(STORY, add_generation_prompt=True)
    prompt_tokens = len(stored_tokenizer.encode(prompt, add_special_tokens=False))
    response = openai_client.chat.completions.create(model=served_model, messages=STORY, temperature=0, max_tokens=10)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 10
    assert response.usage.total_tokens == prompt_tokens + 10

    chunks = _stream(openai_client, model=served_model, messages=STORY, temperature=0, max_tokens=10,
                     stream_options={"include_usage": True})
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    # The same prompt again: its blocks but the last one's are cached now.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    assert usage_chunk.usage.model_dump(exclude={"prompt_tokens_details"}) == response.usage.model_dump(
        exclude={"prompt_tokens_details"})
    assert all(c.usage is None for c in chunks[:-1])


def test_max_completion_tokens(openai_client, served_model) -> None:
    response = openai_client.chat.completions.create(model=served_model, messages=STORY, temperature=0,
                                                     max_completion_tokens=5)
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"


def test_stop_strings_never_reach_the_client(openai_client, served_model) -> None:
    args = dict(model=served_model, messages=STORY, temperature=0, max_tokens=40)
    full = openai_client.chat.completions.create(**args).choices[0].message.content
    words = full.split(" ")
    assert len(words) > 6, full
    stop = " " + " ".join(words[4:6])  # a multi-token stop string from the middle of the answer
    expected = full[: full.index(stop)]

    response = openai_client.chat.completions.create(stop=[stop, "never appears"], **args)
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"

    chunks = _stream(openai_client, stop=stop, **args)
    deltas = _content_deltas(chunks)
    assert "".join(deltas) == expected
    assert not any(stop in d for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_include_stop_str_in_output(openai_client, served_model) -> None:
    args = dict(model=served_model, messages=QUESTION, temperature=0, max_tokens=24)
    full = openai_client.chat.completions.create(**args).choices[0].message.content
    response = openai_client.chat.completions.create(stop="Paris", extra_body={"include_stop_str_in_output": True}, **args)
    assert response.choices[0].message.content == full[: full.index("Paris") + len("Paris")]


def test_n_choices_with_seed(openai_client, served_model) -> None:
    args = dict(model=served_model, messages=STORY, temperature=1.0, max_tokens=16, n=2, seed=1234)
    first = openai_client.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts[0] != texts[1]  # seeds are offset per choice
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 2 * 16
    else:
        assert 0 < first.usage.completion_tokens < 2 * 16
    again = openai_client.chat.completions.create(**args)
    assert [c.message.content for c in again.choices] == texts  # reproducible

    chunks = _stream(openai_client, **args)
    streamed = {0: "", 1: ""}
    roles = {0: 0, 1: 0}
    finishes: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        choice = chunk.choices[0]
        streamed[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role is not None
        finishes[choice.index].append(choice.finish_reason)
    assert [streamed[0], streamed[1]] == texts
    assert roles == {0: 1, 1: 1}
    for reasons in finishes.values():
        assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])


def test_top_k_top_p_accepted(openai_client, served_model) -> None:
    response = openai_client.chat.completions.create(
        model=served_model, messages=QUESTION, temperature=0.7, top_p=0.9, max_tokens=8, seed=7,
        extra_body={"top_k": 20})
    assert response.choices[0].message.content


AWKWARD_TEXTS = ["", "plain", 'say "hi"', "back\\slash", "line\nbreak\ttab\r", "".join(map(chr, range(32))),
                 "\x7f", "héllo ✓ 🙂 日本語", "\u2028\u2029", "</script>", TEXT_PLACEHOLDER]
# A model name equal to the placeholder: the template must fill the text field, not the name.
MODEL = TEXT_PLACEHOLDER


def _chat_chunk(text: str) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id="chatcmpl-1", created=7, model=MODEL, choices=[
        ChatCompletionResponseStreamChoice(index=3, delta=DeltaMessage(content=text))])


def _completion_chunk(text: str) -> CompletionStreamResponse:
    return CompletionStreamResponse(id="cmpl-1", created=7, model=MODEL,
                                    choices=[CompletionResponseChoice(index=3, text=text)])


@pytest.mark.parametrize("make_chunk", [_chat_chunk, _completion_chunk])
def test_text_events_are_the_chunk_models_own_bytes(make_chunk) -> None:
    events = TextEvents(make_chunk(TEXT_PLACEHOLDER))
    for text in AWKWARD_TEXTS:
        assert events(text) == sse_event(make_chunk(text))
