"""The DRY ("don't repeat yourself") sampler, as llama.cpp defines it, in device-agnostic torch.

For a row whose last tokens repeat an earlier stretch of its context, the token that would
continue the repetition is penalized: if the longest suffix of the context that also occurs
earlier, followed there by token t, is L >= allowed_length tokens long, t's logit loses
multiplier * base ** (L - allowed_length). A sequence breaker token (one whose text holds a
breaker string: newline, `:`, `"`, `*` by default) ends the suffix that may match, so repeats
across a breaker are never penalized. The context is the last `penalty_last_n` tokens of the
prompt and the completion (-1: all of them).

Stateless per step: the match lengths are recomputed from the token history with a few batched
tensor ops (a (positions, MAX_MATCH) comparison), on whatever device the logits live. Matches
are counted up to MAX_MATCH tokens: past that the penalty (1.75 ** 62 at the defaults) already
removes the token, as llama.cpp's uncapped one does. Penalties stay finite (llama.cpp's exponent
cap, then a quarter of the dtype's largest value), so a row never loses every token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

MAX_MATCH = 64
_FLOAT_MAX_LOG = 88.7228391  # log(FLT_MAX)


@dataclass(frozen=True)
class DryParams:
    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int  # -1: the whole context; 0: off
    breaker_ids: frozenset[int]


def breaker_token_ids(token_texts: Sequence[str], breakers: Sequence[str]) -> frozenset[int]:
    """The tokens whose text holds one of the breaker strings."""
    return frozenset(t for t, text in enumerate(token_texts) if any(b in text for b in breakers))


def dry_penalties(tokens: torch.Tensor, params: DryParams, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) float32 penalties on `tokens`' device for the row whose context is `tokens`
    (int64, oldest first, already cut to the last penalty_last_n)."""
    penalties = torch.zeros(vocab_size, dtype=torch.float32, device=tokens.device)
    n = tokens.shape[0]
    if n < 2:
        return penalties
    # The suffix that may repeat stops before the last breaker.
    is_breaker = _breaker_flags(tokens, params.breaker_ids)
    breakers_at = torch.nonzero(is_breaker).flatten()
    limit = n - 1 - int(breakers_at[-1]) if breakers_at.numel() else n
    limit = min(limit, MAX_MATCH)
    if limit < max(params.allowed_length, 1):
        return penalties
    # match[j] = common suffix length of tokens[:j+1] and tokens, up to `limit`, for j < n - 1.
    ends = torch.arange(n - 1, device=tokens.device).unsqueeze(1)
    back = torch.arange(limit, device=tokens.device).unsqueeze(0)
    earlier = ends - back
    same = (earlier >= 0) & (tokens[earlier.clamp(min=0)] == tokens[n - 1 - back])
    match = same.to(torch.int64).cumprod(dim=1).sum(dim=1)
    longest = torch.zeros(vocab_size, dtype=torch.int64, device=tokens.device)
    longest.scatter_reduce_(0, tokens[1:], match, reduce="amax")
    hit = longest >= params.allowed_length
    exponent = (longest - params.allowed_length).clamp(min=0).to(torch.float32)
    if params.base > 1.000001:  # llama.cpp's cap: base ** exponent stays a finite float
        exponent = exponent.clamp(max=float(int(_FLOAT_MAX_LOG / math.log(params.base))))
    return torch.where(hit, params.multiplier * torch.pow(params.base, exponent), penalties)


def apply_dry(logits: torch.Tensor, rows: Sequence[tuple[int, Sequence[int], DryParams]]) -> None:
    """Subtract each listed row's DRY penalties from `logits` in place: (logits row, its context
    tokens oldest first, its params). Masked (-inf) tokens stay -inf."""
    for row, context, params in rows:
        window = context if params.penalty_last_n < 0 else context[max(len(context) - params.penalty_last_n, 0):]
        if params.penalty_last_n == 0 or len(window) < 2:
            continue
        tokens = torch.tensor(window, dtype=torch.int64).to(logits.device, non_blocking=True)
        # Finite however large: a token the constraint allows alone must stay drawable.
        penalties = dry_penalties(tokens, params, logits.shape[1]).clamp(max=torch.finfo(logits.dtype).max / 4)
        logits[row] -= penalties.to(logits.dtype)


def _breaker_flags(tokens: torch.Tensor, breaker_ids: frozenset[int]) -> torch.Tensor:
    if not breaker_ids:
        return torch.zeros_like(tokens, dtype=torch.bool)
    ids = torch.tensor(sorted(breaker_ids), dtype=torch.int64).to(tokens.device, non_blocking=True)
    return torch.isin(tokens, ids)
