"""A grammar's token-mask cost, probed: a walk through it on tokens its masks allow, each mask timed.

A step's mask fill returns when its slowest row is done, so a grammar whose masks take milliseconds
(a string `pattern` with `maxLength`: llguidance builds their product's lexer states as it goes)
would hold up every row batched with it (docs/benchmarks/engine.md, session 17). The compiler probes
each new grammar in the background and marks the slow ones, whose rows the engine fills apart from
the batch's (engine/constraint_stage.py); bench/slow_masks.py probes MaskBench.
"""

from __future__ import annotations

import random
import statistics
import time
import zlib
from typing import NamedTuple, Optional, Sequence

import numpy as np
from llguidance import LLMatcher

# 64, not 16: some grammars' masks turn slow only past their first tokens (MaskBench's
# Github_easy---o21456: 0.19 ms a mask on average over this probe's first 16 tokens, 0.75 ms over 64;
# docs/benchmarks/engine.md, session 21), and a batch holding one waits for it every step. Others are
# slow at their start only, which the mean of a longer walk dilutes: `probe_cost` reads both.
PROBE_TOKENS = 64
PROBE_START_TOKENS = 16
_BITS_IN_BYTE = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.int64)


class ProbeWalk(NamedTuple):
    times: list[float]  # each mask's computation time, in seconds
    error: Optional[str]  # llguidance's, where the walk ended on one


def probe_grammar(template: LLMatcher, grammar: str, avoided: Sequence[int] = (),
                  tokens: int = PROBE_TOKENS) -> ProbeWalk:
    """The compiler's probe of a grammar (`grammar`, its text, seeds the walk: the same walk each time)."""
    return mask_probe_seconds(template, tokens, random.Random(zlib.crc32(grammar.encode())), avoided)


def probe_cost(times: Sequence[float]) -> float:
    """The mean mask time a probe judges a grammar by: over its first `PROBE_START_TOKENS` masks or
    over the whole walk, whichever is higher (a grammar slow at its start, or only further on)."""
    return max(statistics.fmean(times[:PROBE_START_TOKENS]), statistics.fmean(times))


def mask_probe_seconds(template: LLMatcher, tokens: int, rng: random.Random,
                       avoided: Sequence[int] = ()) -> ProbeWalk:
    """Each mask's computation time along one walk of up to `tokens` tokens from `template`'s state
    (a copy walks; the lexer states it builds stay with the grammar), each token drawn uniformly from
    those its mask allows, `avoided` (EOS) aside while another is allowed: as a model's choice falls
    anywhere the mask allows. Ends early at the grammar's end or an error (llguidance's, in `error`)."""
    matcher = template.deep_copy()
    times: list[float] = []
    for _ in range(tokens):
        start = time.perf_counter()
        mask = matcher.compute_bitmask()
        times.append(time.perf_counter() - start)
        if matcher.is_error() or matcher.is_stopped():
            break
        token = draw_allowed(np.frombuffer(mask, dtype=np.uint8), rng, avoided)
        if token is None or not matcher.consume_token(token):
            break
    return ProbeWalk(times, matcher.get_error() if matcher.is_error() else None)


def draw_allowed(mask: np.ndarray, rng: random.Random, avoided: Sequence[int] = ()) -> Optional[int]:
    """A token drawn uniformly from those the bitmask `mask` (bytes, bit t%8 of byte t//8) allows,
    `avoided` aside while another is allowed; None when none is. Counts bits per byte rather than
    listing the allowed tokens: the probe runs in the engine's process, and listing a 128k-token
    mask took ~0.6 ms of the GIL a token, this ~0.04 ms."""
    allowed_avoided = [t for t in avoided if t >> 3 < len(mask) and mask[t >> 3] >> (t & 7) & 1]
    counts = np.cumsum(_BITS_IN_BYTE[mask])
    if allowed_avoided and counts[-1] > len(allowed_avoided):
        mask = mask.copy()
        for token in allowed_avoided:
            mask[token >> 3] &= ~np.uint8(1 << (token & 7))
        counts = np.cumsum(_BITS_IN_BYTE[mask])
    if counts[-1] == 0:
        return None
    rank = rng.randrange(int(counts[-1]))  # the rank-th allowed token, from 0
    byte = int(np.searchsorted(counts, rank, side="right"))
    rank -= int(counts[byte - 1]) if byte else 0
    bits = int(mask[byte])
    for bit in range(8):
        if bits >> bit & 1:
            if rank == 0:
                return byte * 8 + bit
            rank -= 1
    raise AssertionError("the counts and the mask disagree")
