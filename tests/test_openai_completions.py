"""/v1/completions (legacy) against a real `bentoml serve`, through the official openai client."""

from __future__ import annotations

PROMPT = "Once upon a time, in a land far away,"


def test_completion_streamed_equals_non_streamed(openai_client, served_model) -> None:
    args = dict(model=served_model, prompt=PROMPT, temperature=0, max_tokens=12)
    whole = openai_client.completions.create(**args)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.choices[0].text

    chunks = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == (
        whole.usage.model_dump(exclude={"prompt_tokens_details"}))


def test_default_max_tokens_is_16(openai_client, served_model) -> None:
    response = openai_client.completions.create(model=served_model, prompt=PROMPT, temperature=0)
    assert response.usage.completion_tokens <= 16
    if response.choices[0].finish_reason == "length":
        assert response.usage.completion_tokens == 16


def test_echo_and_token_prompts(openai_client, served_model) -> None:
    plain = openai_client.completions.create(model=served_model, prompt=PROMPT, temperature=0, max_tokens=6)
    echoed = openai_client.completions.create(model=served_model, prompt=PROMPT, temperature=0, max_tokens=6, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text

    ids = openai_client.completions.create(model=served_model, prompt=[PROMPT, "The sky is"], temperature=0,
                                           max_tokens=6, n=2)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    assert ids.choices[0].text == ids.choices[1].text == plain.choices[0].text  # greedy: n copies agree


def test_completion_stop(openai_client, served_model) -> None:
    args = dict(model=served_model, prompt=PROMPT, temperature=0, max_tokens=30)
    full = openai_client.completions.create(**args).choices[0].text
    stop = full.strip().split(" ")[2]
    expected = full[: full.index(stop)]
    chunks = list(openai_client.completions.create(stream=True, stop=[stop], **args))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == expected
    assert not any(stop in t for t in texts)
    assert chunks[-1].choices[0].finish_reason == "stop"
