"""The mask-fill thread's host work per step at a full batch, on the CPU, phase by phase.

What `MaskPostProcessor.fill` does on the server's fill thread each step (commit each row's token,
compute the masks, settle failed rows, steer the looping rows; the rows near their length limit are
narrowed in `upload`, by a CUDA kernel on a GPU, not timed here),
without a model or a GPU: `--rows` rows of MaskBench schemas drawn at random from the whole pool
(seed printed), compiled as the server compiles a `response_format` json_schema for the Llama 3
tokenizer, each with the server's loop guard for `--max-tokens`. Each step every row's token is drawn
uniformly from what its mask allows (as a random-weight model's argmax falls anywhere the mask
allows); a row that ends (EOS, its limit, a failed grammar) starts again on the next schema.
Reports wall and CPU ms per step of each phase and their total (the fill's time from the tokens
to the masks, on the path to the step's draw), per round (spread over --rounds). The fill's Python
runs under the GIL, which the server's engine thread needs to queue the next step: CPU here is GIL
time there; `masks` is llguidance's (no GIL, on every core but one).

With --per-row, each row's token is committed and its mask computed alone on this thread, timed: the
distribution of one mask's time, and per step the slowest row against the sum over the rows (a
batched fill, in parallel, waits for its slowest row), and how often a row slow at one step
(--slow-ms) is slow at its next; the slowest row of the batch proper leaves out the rows of grammars
the server's probe (--probe-tokens, its walk) marks slow, which it fills apart.

The objects built before the rounds are frozen out of the garbage collector's reach, as the engine
process does once loaded (`heap.freeze_loaded_objects`); the collections the rounds trigger are
reported per generation (count a step, total and longest pause): they hold the GIL.

    python3 bench/fill_step.py --rows 256 --steps 64 --rounds 3
    python3 bench/fill_step.py --rows 256 --steps 64 --rounds 3 --per-row
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from llguidance.torch import allocate_token_bitmask

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from constrained_tbt import DEFAULT_DATA  # noqa: E402
from llama3 import EOT_ID  # noqa: E402
from measure import machine  # noqa: E402
from slow_masks import compiled_draw, llama3_compiler  # noqa: E402

from llgtrt_core.config import LlguidanceConfig  # noqa: E402
from llgtrt_core.heap import freeze_loaded_objects  # noqa: E402
from llgtrt_core.constraints.mask_probe import PROBE_TOKENS, draw_allowed, probe_cost, probe_grammar  # noqa: E402
from llgtrt_core.constraints.postprocessor import MaskPostProcessor  # noqa: E402
from llgtrt_core.engine.interface import ConstrainedRow, LoopGuardSettings  # noqa: E402
from llgtrt_core.engine.step_profile import GcPauses  # noqa: E402
from llgtrt_core.engine.torch_engine import GIL_SWITCH_INTERVAL_CUDA_S  # noqa: E402

CPU = torch.device("cpu")


def gc_report(pauses: GcPauses, steps: int) -> str:
    return "; ".join(f"generation {generation}: {p.count / steps:.2f} a step, {p.total_ms / steps:.3f} ms a step, "
                     f"longest {p.longest_ms:.2f} ms" for generation, p in sorted(pauses.by_generation.items())) or "none"


def fill_row_by_row(rows: list[ConstrainedRow], host: torch.Tensor) -> list[float]:
    """Commit each row's token and compute its mask into host[j], one row at a time: each row's seconds."""
    row_bytes = host.shape[1] * 4
    times = []
    for j, row in enumerate(rows):
        matcher = row.constraint.matcher
        start = time.perf_counter()
        if row.new_token is None or matcher.consume_token(row.new_token):
            matcher.unsafe_compute_mask_ptr(host.data_ptr() + j * row_bytes, row_bytes)
        else:
            row.constraint.fail("token rejected")
        times.append(time.perf_counter() - start)
    return times


def tail_report(times: list[list[float]], apart: list[list[bool]], slow_s: float) -> str:
    """From each step's per-row seconds (rows in order, a row's sequence replaced when it ends) and
    which rows the server fills apart (their grammar's probe marked it slow)."""
    every = sorted(t for step in times for t in step)
    q = lambda xs, p: 1e3 * xs[int(p * (len(xs) - 1))]  # noqa: E731
    slowest = sorted(max(step) for step in times)
    batch_slowest = sorted(max((t for t, out in zip(step, outs) if not out), default=0.0)
                           for step, outs in zip(times, apart))
    sums = sorted(sum(step) for step in times)
    after_slow = [later > slow_s for step, next_step in zip(times, times[1:])
                  for earlier, later in zip(step, next_step) if earlier > slow_s]
    share = sum(t > slow_s for t in every) / len(every)
    return (f"one mask: p50 {q(every, .5):.3f} p90 {q(every, .9):.3f} p99 {q(every, .99):.3f} p99.9 "
            f"{q(every, .999):.3f} max {1e3 * every[-1]:.2f} ms; a step: slowest row p50 {q(slowest, .5):.2f} p90 "
            f"{q(slowest, .9):.2f} ms, the batch's (rows filled apart aside) p50 {q(batch_slowest, .5):.2f} p90 "
            f"{q(batch_slowest, .9):.2f} ms, all rows p50 {q(sums, .5):.2f} ms; slow (> {1e3 * slow_s:g} ms) {share:.2%} "
            f"of masks, {sum(after_slow) / max(len(after_slow), 1):.0%} of those rows slow at their next step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MaskBench folder or a .jsonl.gz pool")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--schemas", type=int, default=128, help="drawn from the pool; rows take them in turn")
    parser.add_argument("--steps", type=int, default=64, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="llguidance's mask pool (default: its own)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--per-row", action="store_true", help="each row's mask alone, timed (no batched fill)")
    parser.add_argument("--slow-ms", type=float, default=0.3, help="with --per-row: a slow mask")
    parser.add_argument("--probe-tokens", type=int, default=PROBE_TOKENS,
                        help="with --per-row: the server's probe walk, whose slow grammars' rows it fills apart")
    args = parser.parse_args()
    seed = random.randrange(2**31) if args.seed is None else args.seed
    print(f"seed {seed}\n{machine()}")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_CUDA_S)  # as the engine process on a GPU sets it
    compiler = llama3_compiler()
    grammars = compiled_draw(compiler, args.data, seed, args.schemas)
    slow_s = LlguidanceConfig().slow_mask_ms / 1e3
    if args.per_row:  # as the server's compiler marks them
        walks = [probe_grammar(grammar.matcher, grammar.grammar, [EOT_ID], args.probe_tokens) for grammar in grammars]
        slow = [grammar for grammar, walk in zip(grammars, walks) if probe_cost(walk.times) >= slow_s]
        for grammar in slow:
            grammar.mask_cost.mark_slow()
        print(f"{len(slow)} of {len(grammars)} grammars slow by a {args.probe_tokens}-token probe: filled apart")
    guard = LoopGuardSettings(max_tokens=args.max_tokens)
    vocab_size = compiler.tokenizer.vocab_size
    processor = MaskPostProcessor(compiler.tokenizer, args.rows, args.threads)
    host = allocate_token_bitmask(args.rows, vocab_size)  # --per-row's masks
    rng = random.Random(seed)
    turn = 0

    def fresh():
        nonlocal turn
        turn += 1
        return compiler.new_constraint(grammars[turn % len(grammars)], "response_format", loop_guard=guard)

    rows = [ConstrainedRow(fresh(), j, None) for j in range(args.rows)]
    lengths = [0] * args.rows
    freeze_loaded_objects()
    pauses = GcPauses()
    per_round = []
    for round_ in range(args.rounds):
        processor.phases.totals.clear()
        row_times: list[list[float]] = []
        row_apart: list[list[bool]] = []
        for _ in range(args.steps):
            if args.per_row:
                row_apart.append([row.constraint.mask_cost.slow for row in rows])
                row_times.append(fill_row_by_row(rows, host))
                masks = host.numpy()
            else:  # as the sampler sees them: uploaded (the closing rows narrowed; on a GPU by a kernel)
                masks = processor.upload(rows, processor.fill(rows), CPU)[0].numpy()
            for j, row in enumerate(rows):
                token = draw_allowed(masks[j].view(np.uint8), rng)
                token = EOT_ID if token is None else token
                lengths[j] += 1
                if row.constraint.error is not None or token == EOT_ID or lengths[j] >= args.max_tokens:
                    rows[j], lengths[j] = ConstrainedRow(fresh(), j, None), 0
                else:
                    rows[j] = ConstrainedRow(row.constraint, j, token)
        if args.per_row:
            print(f"round {round_ + 1}: {tail_report(row_times, row_apart, args.slow_ms / 1e3)}", flush=True)
            continue
        totals = processor.phases.snapshot()
        per_round.append({name: (1e3 * t["wall_s"] / args.steps, 1e3 * t["cpu_s"] / args.steps)
                          for name, t in totals.items()})
        per_round[-1]["total"] = tuple(sum(phase[i] for phase in per_round[-1].values()) for i in (0, 1))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {wall:.3f} / {cpu:.3f}"
                                                    for name, (wall, cpu) in per_round[-1].items())
              + " ms a step (wall / CPU)", flush=True)
    print(f"garbage collections in the rounds: {gc_report(pauses, args.steps * args.rounds)}")
    if args.per_row:
        return
    print(f"{len(grammars)} schemas, {args.rows} rows, max_tokens {args.max_tokens}, {args.steps} steps x "
          f"{args.rounds} rounds; ms a step, median (min-max) of the rounds:")
    for name in per_round[0]:
        for kind, index in (("wall", 0), ("CPU", 1)):
            values = [r[name][index] for r in per_round if name in r]
            print(f"  {name:8s} {kind:4s} {statistics.median(values):7.3f} ({min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
