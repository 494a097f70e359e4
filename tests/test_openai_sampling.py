"""Every sampling control and logprobs, through the official openai client against `bentoml serve`."""

from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llgtrt_core.tokenizer import Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
YES_NO = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
REPETITIVE = "apple apple apple apple apple apple apple apple"


@pytest.fixture(scope="module")
def tokenizer(stored_model_dir) -> Tokenizer:
    return Tokenizer(stored_model_dir)


def _chat(openai_client, served_model, **args):
    return openai_client.chat.completions.create(model=served_model, **{"messages": QUESTION, **args})


def _assert_same_logprobs(streamed: list, whole: list) -> None:
    assert [t.token for t in streamed] == [t.token for t in whole]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-4)
    assert [[e.token for e in t.top_logprobs] for t in streamed] == [[e.token for e in t.top_logprobs] for t in whole]


# --------------------------------------------------------------------------- logprobs


def test_chat_logprobs_of_greedy_tokens(openai_client, served_model) -> None:
    response = _chat(openai_client, served_model, temperature=0, max_tokens=6, logprobs=True, top_logprobs=5)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert len(token.top_logprobs) == 5
        assert token.logprob == pytest.approx(max(e.logprob for e in token.top_logprobs))  # greedy: the top one
        assert token.top_logprobs[0].token == token.token
        assert sum(math.exp(e.logprob) for e in token.top_logprobs) <= 1 + 1e-4
        assert bytes(token.bytes).decode() == token.token
        assert [e.logprob for e in token.top_logprobs] == sorted((e.logprob for e in token.top_logprobs), reverse=True)

    without_top = _chat(openai_client, served_model, temperature=0, max_tokens=3, logprobs=True)
    assert [t.top_logprobs for t in without_top.choices[0].logprobs.content] == [[], [], []]
    assert _chat(openai_client, served_model, temperature=0, max_tokens=3).choices[0].logprobs is None


def test_chat_streamed_logprobs_equal_non_streamed(openai_client, served_model) -> None:
    args = dict(temperature=0, max_tokens=10, logprobs=True, top_logprobs=2, stop=[" is"], n=2)
    whole = _chat(openai_client, served_model, **args)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in _chat(openai_client, served_model, stream=True, **args):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.content
    for index in (0, 1):
        _assert_same_logprobs(streamed[index], whole.choices[index].logprobs.content)


def test_completion_logprobs_with_echo(openai_client, served_model, tokenizer) -> None:
    prompt = "Once upon a time"
    args = dict(model=served_model, prompt=prompt, temperature=0, max_tokens=5, logprobs=3, echo=True)
    whole = openai_client.completions.create(**args).choices[0]
    logprobs = whole.logprobs
    prompt_ids = tokenizer.encode(prompt)
    assert len(logprobs.tokens) == len(prompt_ids) + 5
    assert "".join(logprobs.tokens) == whole.text and whole.text.startswith(prompt)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == pytest.approx(logprob)  # the sampled token is always listed
        assert 3 <= len(top) <= 4
    for token, logprob, top in zip(logprobs.tokens[-5:], logprobs.token_logprobs[-5:], logprobs.top_logprobs[-5:]):
        assert logprob == pytest.approx(max(top.values()))  # generated greedily

    chunks = list(openai_client.completions.create(stream=True, **args))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert sum((p.tokens for p in streamed), []) == logprobs.tokens
    assert sum((p.text_offset for p in streamed), []) == logprobs.text_offset
    assert sum((p.token_logprobs for p in streamed), [])[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)


def test_prompt_logprobs_score_a_token_as_generation_did(openai_client, served_model, tokenizer) -> None:
    prompt = tokenizer.encode("The sky is")
    args = dict(model=served_model, temperature=0, max_tokens=1, logprobs=2)
    generated = openai_client.completions.create(prompt=prompt, **args).choices[0].logprobs
    token_id = tokenizer.encode(generated.tokens[0], add_special_tokens=False)[0]
    echoed = openai_client.completions.create(prompt=prompt + [token_id], echo=True, **args).choices[0].logprobs
    assert echoed.tokens[len(prompt)] == generated.tokens[0]
    assert echoed.token_logprobs[len(prompt)] == pytest.approx(generated.token_logprobs[0], abs=1e-3)
    assert echoed.top_logprobs[len(prompt)] == pytest.approx(generated.top_logprobs[0], abs=1e-3)


def test_processed_logprobs_follow_the_constraint(openai_client, served_model) -> None:
    """Raw: the model's own distribution (the allowed token may rank low); processed: the masked one."""
    args = dict(messages=YES_NO, temperature=0, max_tokens=3, logprobs=True, top_logprobs=3)
    raw = _chat(openai_client, served_model, extra_body={"guided_choice": ["yes", "no"]}, **args)
    processed = _chat(openai_client, served_model,
                      extra_body={"guided_choice": ["yes", "no"], "logprobs_mode": "processed_logprobs"}, **args)
    assert raw.choices[0].message.content == processed.choices[0].message.content
    assert raw.choices[0].message.content in ("yes", "no")
    first_raw, first_processed = raw.choices[0].logprobs.content[0], processed.choices[0].logprobs.content[0]
    assert first_processed.logprob >= first_raw.logprob
    assert first_processed.top_logprobs[0].token == first_processed.token
    allowed = [e for e in first_processed.top_logprobs if e.logprob > -9999]
    assert all("yes".startswith(e.token) or "no".startswith(e.token) for e in allowed)
    assert sum(math.exp(e.logprob) for e in allowed) == pytest.approx(1.0, abs=0.05)


# --------------------------------------------------------------------------- sampling controls


def test_logit_bias_bans_and_forces_tokens(openai_client, served_model, tokenizer) -> None:
    args = dict(model=served_model, prompt="The sky is", temperature=0, max_tokens=4, logprobs=0)
    plain = openai_client.completions.create(**args).choices[0]
    first = tokenizer.encode(plain.logprobs.tokens[0], add_special_tokens=False)[0]
    banned = openai_client.completions.create(logit_bias={str(first): -100}, **args).choices[0]
    assert plain.logprobs.tokens[0] not in banned.logprobs.tokens

    banana = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = openai_client.completions.create(logit_bias={str(banana): 100}, **args).choices[0]
    assert forced.text == " banana" * 4

    constrained = _chat(openai_client, served_model, messages=YES_NO, temperature=0, max_tokens=4,
                        logit_bias={str(banana): 100}, extra_body={"guided_choice": ["yes", "no"]})
    assert constrained.choices[0].message.content in ("yes", "no")  # the constraint wins over the bias


def _distinct_tokens(openai_client, served_model, **args) -> int:
    choice = openai_client.completions.create(model=served_model, prompt=REPETITIVE, temperature=0, max_tokens=16,
                                              logprobs=0, **args).choices[0]
    return len(Counter(choice.logprobs.tokens))


def test_penalties_change_repetition_in_the_expected_direction(openai_client, served_model) -> None:
    baseline = _distinct_tokens(openai_client, served_model)
    assert _distinct_tokens(openai_client, served_model, frequency_penalty=1.0) > baseline
    assert _distinct_tokens(openai_client, served_model, presence_penalty=1.5) > baseline
    assert _distinct_tokens(openai_client, served_model, extra_body={"repetition_penalty": 1.5}) > baseline
    assert _distinct_tokens(openai_client, served_model, presence_penalty=-2.0) < baseline
    assert _distinct_tokens(openai_client, served_model, extra_body={"repetition_penalty": 0.7}) < baseline


def test_min_tokens_and_ignore_eos(openai_client, served_model) -> None:
    args = dict(messages=YES_NO, temperature=0, max_tokens=12)
    short = _chat(openai_client, served_model, **args)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 6
    held = _chat(openai_client, served_model, extra_body={"min_tokens": 6}, **args)
    assert held.usage.completion_tokens >= 6
    ignored = _chat(openai_client, served_model, extra_body={"ignore_eos": True}, **args)
    assert ignored.usage.completion_tokens == 12 and ignored.choices[0].finish_reason == "length"
    shown = _chat(openai_client, served_model, extra_body={"ignore_eos": True, "skip_special_tokens": False}, **args)
    assert "<|im_end|>" in shown.choices[0].message.content
    assert "<|im_end|>" not in ignored.choices[0].message.content


def test_stop_token_ids(openai_client, served_model, tokenizer) -> None:
    args = dict(model=served_model, prompt="Once upon a time", temperature=0, max_tokens=8, logprobs=0)
    plain = openai_client.completions.create(**args).choices[0]
    third = tokenizer.encode(plain.logprobs.tokens[2], add_special_tokens=False)[0]
    stopped = openai_client.completions.create(extra_body={"stop_token_ids": [third]}, **args).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.logprobs.tokens == plain.logprobs.tokens[:2]


def test_a_seed_gives_the_same_text_alone_and_in_a_busy_batch(openai_client, served_model) -> None:
    args = dict(messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0, max_tokens=12, seed=42)
    alone = _chat(openai_client, served_model, **args).choices[0].message.content
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(_chat, openai_client, served_model, temperature=0.8, max_tokens=16,
                              messages=[{"role": "user", "content": f"Count to {i}"}], frequency_penalty=0.5,
                              extra_body={"top_k": 5})
                  for i in range(5)]
        busy = pool.submit(_chat, openai_client, served_model, **args)
        assert busy.result().choices[0].message.content == alone
        assert all(o.result().choices for o in others)


def test_best_of_returns_the_most_likely_candidate(openai_client, served_model) -> None:
    """best_of=3 draws the candidates n=3 draws (same seeds) and returns the best per token."""
    args = dict(model=served_model, prompt="The best fruit is", temperature=1.0, max_tokens=6, seed=5)
    candidates = openai_client.completions.create(n=3, logprobs=0, **args)
    best = openai_client.completions.create(best_of=3, **args)
    assert len(best.choices) == 1
    assert best.usage.completion_tokens == candidates.usage.completion_tokens  # every candidate is billed
    by_mean = max(candidates.choices, key=lambda c: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs))
    assert best.choices[0].text == by_mean.text


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", {"messages": QUESTION, "top_logprobs": 0}, "top_logprobs"),
    ("/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/chat/completions", {"messages": QUESTION, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/chat/completions", {"messages": QUESTION, "logit_bias": {"5": -101}}, "logit_bias"),
    ("/chat/completions", {"messages": QUESTION, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/chat/completions", {"messages": QUESTION, "presence_penalty": -3}, "presence_penalty"),
    ("/chat/completions", {"messages": QUESTION, "min_p": 1.5}, "min_p"),
    ("/chat/completions", {"messages": QUESTION, "top_k": -2}, "top_k"),
    ("/chat/completions", {"messages": QUESTION, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/chat/completions", {"messages": QUESTION, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/chat/completions", {"messages": QUESTION, "logprobs": True, "logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ("/completions", {"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ("/completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ("/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/completions", {"prompt": "x", "suffix": "!"}, "suffix"),
])
def test_bad_sampling_parameters_name_the_parameter(server, served_model, path, body, param) -> None:
    response = httpx.post(f"{server}/v1{path}", json={"model": served_model, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
