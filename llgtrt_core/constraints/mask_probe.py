"""A grammar's token-mask cost, probed: a walk through it on tokens its masks allow, each mask timed.

A step's mask fill returns when its slowest row is done, so a grammar whose masks take milliseconds
(a string `pattern` with `maxLength`: llguidance builds their product's lexer states as it goes)
would hold up every row batched with it (docs/benchmarks/engine.md, session 17). The compiler probes
each new grammar in the background and marks the slow ones, whose rows the engine fills apart from
the batch's (engine/constraint_stage.py); bench/slow_masks.py probes MaskBench.
"""

from __future__ import annotations

import random
import time
from typing import Sequence

import numpy as np
from llguidance import LLMatcher

# A walk of 5-9 ms for a median MaskBench schema with 128k tokens (mostly reading the masks), 60-90 ms for the slowest.
PROBE_TOKENS = 16


def mask_probe_seconds(template: LLMatcher, tokens: int, rng: random.Random,
                       avoided: Sequence[int] = ()) -> list[float]:
    """Each mask's computation time along one walk of up to `tokens` tokens from `template`'s state
    (a copy walks; the lexer states it builds stay with the grammar), each token drawn uniformly from
    those its mask allows, `avoided` (EOS) aside while another is allowed: as a model's choice falls
    anywhere the mask allows. Ends early at the grammar's end or an error."""
    matcher = template.deep_copy()
    times: list[float] = []
    for _ in range(tokens):
        start = time.perf_counter()
        mask = matcher.compute_bitmask()
        times.append(time.perf_counter() - start)
        if matcher.is_error() or matcher.is_stopped():
            break
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little"))
        others = allowed[~np.isin(allowed, avoided)]  # a few avoided tokens: one pass over `allowed` each
        choices = others if len(others) else allowed
        if len(choices) == 0 or not matcher.consume_token(int(rng.choice(choices))):
            break
    return times
