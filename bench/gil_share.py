"""What the mask fill's Python costs the engine thread through the GIL, and what a process of its
own would save (docs/architecture.md's plan for issue 15), on the host alone (no GPU, no model).

A stand-in for the engine thread runs steps beside the real fill of --rows rows (MaskBench schemas
drawn at random from the whole pool, the server's compiler and loop guards, `MaskPostProcessor.fill`
with its llguidance pool), in one of three modes: `none` (no fill: a plain step), `thread` (the fill
on a thread of the same process, as the server runs it) or `process` (the fill in a process of its
own, started by spawn, a step's start and end crossing a pipe; the masks' hand-over through shared
memory is not included). A step: the fill of that step starts; the stand-in does the host work
before the masks are needed (Python over every row, as `advance` and `schedule`, and --before-calls
torch calls), waits for the fill, does the work after it (--after-calls torch calls, as the upload,
the draw and the next decode make, each giving the GIL up as the server's do, and Python), then
sleeps out the rest of --period-ms (a decode on the GPU, during which the server's engine thread
waits in a device sync). The fill replays tokens recorded
beforehand from a walk through each row's masks (each token drawn uniformly from what its mask
allows, as a random-weight model's argmax falls; a row that ends starts again on the next schema),
so both sides do only what they do in the server. The stand-in's Python is sized alone (no fill
beside) to about --before-ms and --after-ms.

Reports per mode and round the stand-in's work before and after the wait (wall: what sharing the
GIL adds to it), its wait for the masks and its whole chain from the step's start to the work's end
(p50 / p90 / p99 over the steps), and the fill's own time. Rounds rotate the modes; each fill side
replays one round untimed first (llguidance's caches warm). With `python3 bench/cpu_thief.py` beside
it, the same under CPU taken.

    python3 bench/gil_share.py --rows 256 --steps 150 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing
import operator
import random
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from multiprocessing.connection import Connection
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from constrained_tbt import DEFAULT_DATA  # noqa: E402
from llama3 import EOT_ID  # noqa: E402
from measure import machine  # noqa: E402
from slow_masks import compiled_draw, llama3_compiler  # noqa: E402

from llgtrt_core.constraints.mask_probe import draw_allowed  # noqa: E402
from llgtrt_core.constraints.postprocessor import MaskPostProcessor  # noqa: E402
from llgtrt_core.engine.interface import ConstrainedRow, LoopGuardSettings  # noqa: E402
from llgtrt_core.engine.torch_engine import GIL_SWITCH_INTERVAL_CUDA_S  # noqa: E402
from llgtrt_core.heap import freeze_loaded_objects  # noqa: E402

MODES = ("none", "thread", "process")
_NEW_ROW = functools.partial(tuple.__new__, ConstrainedRow)  # as constraint_stage.py builds them, in C
_NEGATIVE = functools.partial(operator.gt, 0)  # 0 > entry: a row that starts again
Step = list[int]  # per row: the token to commit, or -1 - g: a fresh constraint of grammar g (nothing to commit)


class FillSide:
    """The rows' constraints, replaying recorded steps through the server's post-processor."""

    def __init__(self, data: Path, seed: int, rows: int, schemas: int, max_tokens: int, loop_guard: bool) -> None:
        self.compiler = llama3_compiler()
        self.grammars = compiled_draw(self.compiler, data, seed, schemas)
        self.guard = LoopGuardSettings(max_tokens=max_tokens) if loop_guard else None
        self.processor = MaskPostProcessor(self.compiler.tokenizer, rows)
        self.constraints: list = [None] * rows

    def fill(self, step: Step) -> torch.Tensor:
        """The step's rows built as the server's fill thread builds them (C-level passes, the
        constraints of rows that started again aside), then the server's fill."""
        for j in itertools.compress(range(len(step)), map(_NEGATIVE, step)):
            self.constraints[j] = self.compiler.new_constraint(self.grammars[-1 - step[j]], "response_format",
                                                               loop_guard=self.guard)
        tokens = [None if token < 0 else token for token in step] if min(step) < 0 else step
        return self.processor.fill(list(map(_NEW_ROW, zip(self.constraints, range(len(step)), tokens))))

    def timed_fill(self, step: Step) -> float:
        """`fill`, its ms."""
        start = time.perf_counter()
        self.fill(step)
        return 1e3 * (time.perf_counter() - start)

    def record(self, steps: int, max_tokens: int, rng: random.Random) -> list[Step]:
        """`steps` steps of every row, each token drawn from its mask."""
        rows = len(self.constraints)
        turn = rows
        step = [-1 - j % len(self.grammars) for j in range(rows)]
        lengths = [0] * rows
        recorded = []
        for _ in range(steps):
            recorded.append(step)
            masks = self.fill(step).numpy()
            step = []
            for j in range(rows):
                token = draw_allowed(masks[j].view(np.uint8), rng)
                lengths[j] += 1
                if self.constraints[j].error is not None or token in (None, EOT_ID) or lengths[j] >= max_tokens:
                    step.append(-1 - turn % len(self.grammars))
                    turn, lengths[j] = turn + 1, 0
                else:
                    step.append(token)
        return recorded


def fill_process(conn: Connection, args: argparse.Namespace, seed: int, recorded: list[Step]) -> None:
    """The `process` mode's fill: replays step i when sent i, answers when its masks are done."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_CUDA_S)
    side = FillSide(args.data, seed, args.rows, args.schemas, args.max_tokens, args.loop_guard == "on")
    freeze_loaded_objects()
    conn.send("ready")
    while (index := conn.recv()) is not None:
        conn.send(side.timed_fill(recorded[index]))


class _Seq:
    __slots__ = ("length", "tokens")

    def __init__(self) -> None:
        self.length, self.tokens = 0, []


class EngineStandIn:
    """The engine thread's host work per step: Python over every row, and small torch calls (each
    gives the GIL up, as the server's torch calls and device syncs do)."""

    def __init__(self, rows: int) -> None:
        self.seqs = [_Seq() for _ in range(rows)]
        self.scratch = torch.zeros(rows)
        self.passes_before = self.passes_after = 1
        self.calls_before = self.calls_after = 1

    def python_pass(self) -> list:
        out = []
        for seq in self.seqs:
            seq.length += 1
            seq.tokens.append(seq.length)
            if len(seq.tokens) > 64:
                seq.tokens.clear()
            out.append((seq, seq.length))
        return out

    def torch_calls(self, count: int) -> None:
        for _ in range(count):
            self.scratch.add_(1.0)

    def before(self) -> None:  # advance, deliver, schedule, begin: Python, a few torch calls
        for _ in range(self.passes_before):
            self.python_pass()
        self.torch_calls(self.calls_before)

    def after(self) -> None:  # mask upload, sample, the next decode queued: torch calls and some Python
        self.torch_calls(self.calls_after)
        for _ in range(self.passes_after):
            self.python_pass()

    def calibrate(self, before_ms: float, after_ms: float, before_calls: int, after_calls: int,
                  period_s: float) -> None:
        """The Python passes that, with the torch calls given, take `before_ms` and `after_ms` alone
        (no fill beside): set from one pass's time, then scaled by what steps took at the steps' pace
        (a core that slept between steps runs the next one slower than a loop of them)."""
        self.calls_before, self.calls_after = before_calls, after_calls
        pass_ms = _median_ms(self.python_pass)
        for _ in range(4):
            self.passes_before = max(1, round(before_ms / pass_ms))
            self.passes_after = max(1, round(after_ms / pass_ms))
            phases = run_round(self, [[]] * 30, period_s)
            pass_ms *= statistics.median(phases["before"]) / before_ms


def _median_ms(work: Callable[[], object], repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_round(engine: EngineStandIn, recorded: list[Step], period_s: float,
              fill: Optional[tuple[Callable[[int], object], Callable[[int], float]]] = None) -> dict[str, list[float]]:
    """One pass over the recorded steps, with `fill` (start step i's fill, wait for it: its ms) or
    none: each phase's ms a step."""
    phases: dict[str, list[float]] = {"before": [], "wait": [], "after": [], "chain": [], "fill": []}
    for index in range(len(recorded)):
        start = time.perf_counter()
        if fill is not None:
            fill[0](index)
        engine.before()
        ready = time.perf_counter()
        if fill is not None:
            phases["fill"].append(fill[1](index))
        waited = time.perf_counter()
        engine.after()
        end = time.perf_counter()
        for name, value in (("before", ready - start), ("wait", waited - ready), ("after", end - waited),
                            ("chain", end - start)):
            phases[name].append(1e3 * value)
        time.sleep(max(0.0, start + period_s - time.perf_counter()))
    return phases


def quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    q = lambda p: ordered[int(p * (len(ordered) - 1))]  # noqa: E731
    return f"{q(.5):6.2f} {q(.9):6.2f} {q(.99):6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MaskBench folder or a .jsonl.gz pool")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--schemas", type=int, default=128, help="drawn from the pool; rows take them in turn")
    parser.add_argument("--steps", type=int, default=150, help="per round")
    parser.add_argument("--rounds", type=int, default=3, help="of each mode")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--period-ms", type=float, default=9.5, help="a decode step on the GPU")
    parser.add_argument("--before-ms", type=float, default=2.5, help="the stand-in's work before the masks")
    parser.add_argument("--after-ms", type=float, default=1.6, help="its work after them")
    parser.add_argument("--before-calls", type=int, default=5, help="torch calls in the work before the masks")
    parser.add_argument("--after-calls", type=int, default=40, help="torch calls after them (upload, draw, next decode)")
    parser.add_argument("--modes", default=" ".join(MODES), help="of none, thread, process")
    parser.add_argument("--loop-guard", choices=("on", "off"), default="on", help="the rows' loop guards")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = random.randrange(2**31) if args.seed is None else args.seed
    print(f"seed {seed}\n{machine()}", flush=True)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_CUDA_S)  # as the engine process on a GPU sets it
    side = FillSide(args.data, seed, args.rows, args.schemas, args.max_tokens, args.loop_guard == "on")
    recorded = side.record(args.steps, args.max_tokens, random.Random(seed))
    modes = [mode for mode in MODES if mode in args.modes.split()]
    conn = child = None
    if "process" in modes:
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        child = context.Process(target=fill_process, args=(child_conn, args, seed, recorded), daemon=True)
        child.start()
        assert conn.recv() == "ready"
    engine = EngineStandIn(args.rows)
    engine.calibrate(args.before_ms, args.after_ms, args.before_calls, args.after_calls, args.period_ms / 1e3)
    freeze_loaded_objects()
    pool = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
    pending: list[Future] = []  # the thread's fill of the step under way
    fills = {"none": None, "thread": (lambda i: pending.append(pool.submit(side.timed_fill, recorded[i])),
                                      lambda i: pending.pop().result())}
    if conn is not None:
        fills["process"] = (conn.send, lambda i: conn.recv())
    for mode in set(modes) - {"none"}:  # warm llguidance's caches on each fill side
        run_round(engine, recorded, 0.0, fills[mode])
    print(f"{args.rows} rows of {len(side.grammars)} schemas, {args.steps} steps a round, period {args.period_ms} ms; "
          f"stand-in alone: {args.before_ms} ms before the masks, {args.after_ms} ms after, {args.before_calls} and "
          f"{args.after_calls} torch calls; loop guards {args.loop_guard}", flush=True)
    print("ms a step, p50 p90 p99:\nmode     round | before             | wait               | after              | "
          "chain              | fill")
    chains: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        turn = round_ % len(modes)
        for mode in modes[turn:] + modes[:turn]:
            phases = run_round(engine, recorded, args.period_ms / 1e3, fills[mode])
            chains[mode].append(statistics.mean(phases["chain"]))
            print(f"{mode:8s} {round_ + 1:5d} | " + " | ".join(quantiles(phases[name]) if phases[name] else "-"
                                                           for name in ("before", "wait", "after", "chain", "fill")),
                  flush=True)
    if child is not None:
        conn.send(None)
        child.join(10)
    print("chain mean, ms a step (the rounds): " + "; ".join(
        f"{mode} {statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"
        for mode, values in chains.items()))


if __name__ == "__main__":
    main()
