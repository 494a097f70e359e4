"""The DRY sampler against a direct transcription of llama.cpp's definition, and its effect on
the logits (masked tokens stay masked, breakers stop the match)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from llgtrt_core.engine.dry import MAX_MATCH, DryParams, apply_dry, dry_penalties

VOCAB = 12


def reference(tokens: list[int], params: DryParams) -> dict[int, float]:
    """llama.cpp's llama_sampler_dry_apply, position by position (no Z-algorithm)."""
    n = len(tokens) if params.penalty_last_n < 0 else min(len(tokens), params.penalty_last_n)
    last = tokens[len(tokens) - n:]
    if n <= params.allowed_length:
        return {}
    rep_limit = n
    for i in range(n):  # tokens back from the end to the first breaker
        if last[n - 1 - i] in params.breaker_ids:
            rep_limit = i
            break
    if rep_limit < params.allowed_length:
        return {}
    longest: dict[int, int] = {}
    for k in range(1, n):  # an earlier stretch ending k tokens before the end, followed by last[n - k]
        length = 0
        while length + k < n and last[n - 1 - length] == last[n - 1 - k - length]:
            length += 1
        length = min(length, rep_limit)
        if length >= params.allowed_length:
            token = last[n - k]
            longest[token] = max(longest.get(token, 0), length)
    max_exponent = int(88.7228391 / math.log(params.base)) if params.base > 1.000001 else 0
    penalties = {}
    for token, length in longest.items():
        exponent = length - params.allowed_length
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        penalties[token] = params.multiplier * params.base**exponent
    return penalties


@pytest.mark.parametrize("seed", range(40))
def test_penalties_match_llama_cpp(seed: int) -> None:
    rng = random.Random(seed)
    # Few distinct tokens and pasted repeats: long matches, breakers inside and outside them.
    tokens = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 20))]
    for _ in range(rng.randrange(4)):
        start = rng.randrange(len(tokens))
        tokens += tokens[start:start + rng.randrange(1, 12)]
    params = DryParams(multiplier=rng.choice([0.5, 0.8, 2.0]), base=rng.choice([1.0, 1.75, 3.0]),
                       allowed_length=rng.choice([1, 2, 3]), penalty_last_n=rng.choice([-1, 8, 30]),
                       breaker_ids=frozenset(rng.sample(range(VOCAB), rng.randrange(3))))
    window = tokens if params.penalty_last_n < 0 else tokens[-params.penalty_last_n:]
    expected = torch.zeros(VOCAB)
    for token, penalty in reference(tokens, params).items():
        expected[token] = penalty
    assert len(window) < MAX_MATCH
    assert torch.allclose(dry_penalties(torch.tensor(window), params, VOCAB), expected, rtol=1e-5)


def test_apply_dry_penalizes_the_repeating_token_and_keeps_masked_tokens_masked() -> None:
    params = DryParams(multiplier=0.8, base=1.75, allowed_length=2, penalty_last_n=-1, breaker_ids=frozenset({9}))
    logits = torch.zeros(2, VOCAB)
    logits[0, 4] = float("-inf")
    context = [1, 2, 3, 4, 1, 2, 3]  # 1 2 3 was followed by 4: continuing it is a repeat of length 3
    apply_dry(logits, [(0, context, params)])
    assert logits[0, 4] == float("-inf")
    apply_dry(logits, [(1, context, params)])
    assert logits[1, 4] == pytest.approx(-0.8 * 1.75)
    assert torch.count_nonzero(logits[1]) == 1  # nothing else repeats
    broken = torch.zeros(1, VOCAB)
    apply_dry(broken, [(0, [1, 2, 3, 4, 1, 9, 2, 3], params)])  # a breaker cuts the suffix to "2 3"
    assert broken[0, 4] == pytest.approx(-0.8)
