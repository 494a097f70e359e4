"""Fast-forward: tokens a grammar forces are fed without sampling, several in one forward pass.

On the real default model with real llguidance: `extend` matches a prefill of the same tokens,
greedy constrained output is the same token for token with and without fast-forward (in fewer
steps with it), and max_tokens, logprobs and batching with other requests behave as before.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import jsonschema
import llguidance
import pytest
import torch

from llgtrt_core.constraints import GrammarCompiler, build_ll_tokenizer
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams, TokenLogprob
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.models.llama import Segment
from llgtrt_core.models.loader import load_model
from llgtrt_core.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(stored_model_dir: Path) -> Tokenizer:
    return Tokenizer(stored_model_dir)


@pytest.fixture(scope="module")
def ll_tokenizer(stored_model_dir: Path, tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    vocab_size = json.loads((stored_model_dir / "config.json").read_text())["vocab_size"]
    return build_ll_tokenizer(tokenizer.hf, vocab_size, sorted(tokenizer.eos_token_ids))


def chat_prompt(tokenizer: Tokenizer, question: str) -> list[int]:
    ids = tokenizer.hf.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


Result = tuple[list[int], Optional[str], Optional[list[TokenLogprob]]]


def run_engine(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer, fast_forward: bool,
               specs: list[tuple[str, bool, SamplingParams]], prefill_chunk_tokens: Optional[int] = None,
               overlap_steps: bool = False) -> tuple[list[Result], int]:
    """Run requests (prompt question, constrained?, sampling) concurrently on a fresh engine;
    return each one's tokens, finish reason and logprobs, and the steps the engine took."""

    async def generate() -> tuple[list[Result], int]:
        compiler = GrammarCompiler(ll_tokenizer)
        # float32: runs with and without fast-forward are batched differently, which can flip a
        # greedy near-tie in bfloat16 (the CPU default; test_torch_engine.BATCH_EXACT_CPU)
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", dtype="float32", max_batch_size=4,
                                                                 fast_forward=fast_forward,
                                                                 prefill_chunk_tokens=prefill_chunk_tokens,
                                                                 overlap_steps=overlap_steps),
                             MaskPostProcessor(ll_tokenizer, max_batch_size=4))
        await engine.start()
        try:
            compiled = await compiler.compile(json_schema_grammar(SCHEMA))

            async def one(i: int, question: str, constrained: bool, sampling: SamplingParams) -> Result:
                request = GenerationRequest(f"r{i}", chat_prompt(tokenizer, question), sampling,
                                            compiler.new_constraint(compiled) if constrained else None)
                tokens, reason, logprobs = [], None, None
                async for delta in engine.generate(request):
                    tokens += delta.token_ids
                    reason = delta.finish_reason
                    if delta.logprobs is not None:
                        logprobs = (logprobs or []) + delta.logprobs
                return tokens, reason, logprobs

            results = await asyncio.gather(*(one(i, *spec) for i, spec in enumerate(specs)))
            return list(results), engine.num_steps
        finally:
            await engine.shutdown()
            compiler.close()

    return asyncio.run(generate())


def greedy(tokenizer: Tokenizer, **extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "stop_token_ids": tokenizer.eos_token_ids, "max_tokens": 100,
                             **extra})


def test_extend_matches_a_prefill_of_the_same_tokens(stored_model_dir: Path, tokenizer: Tokenizer) -> None:
    model = load_model(stored_model_dir, 256, torch.float32, torch.device("cpu"))
    config = model.config
    cache = KVCache(config.num_layers, 2, config.num_kv_heads, config.head_dim, 256, torch.float32,
                    torch.device("cpu"), block_size=4)
    tokens = torch.tensor(chat_prompt(tokenizer, "Name a city.") + tokenizer.encode('{"city":"Paris"}'))
    assert cache.allocate(0, len(tokens)) and cache.allocate(1, len(tokens))
    cache.sync_table()
    expected = model.extend(tokens, cache, slot=0)
    model.extend(tokens[:-5], cache, slot=1)
    extended = model.extend(tokens[-5:], cache, slot=1, start=len(tokens) - 5)
    assert torch.allclose(extended, expected, atol=1e-4), (extended - expected).abs().max()
    for got, want in zip(cache.read(3, 1, len(tokens)), cache.read(3, 0, len(tokens))):
        assert torch.allclose(got, want, atol=1e-4)


def test_extend_batch_matches_one_extend_per_slot(stored_model_dir: Path, tokenizer: Tokenizer) -> None:
    """Segments of several slots in one pass (a fresh prompt, a continuation of a cached one, a
    single token): the same logits and cached keys as one `extend` per slot."""
    model = load_model(stored_model_dir, 256, torch.float32, torch.device("cpu"))
    config = model.config
    caches = [KVCache(config.num_layers, 3, config.num_kv_heads, config.head_dim, 256, torch.float32,
                      torch.device("cpu"), block_size=4) for _ in range(2)]
    first = torch.tensor(chat_prompt(tokenizer, "Name a city."))
    second = torch.tensor(chat_prompt(tokenizer, "Write a haiku about the sea."))
    for cache in caches:
        assert cache.allocate(0, len(first)) and cache.allocate(1, 1) and cache.allocate(2, len(second))
        cache.sync_table()
        model.extend(second[:10], cache, slot=2)  # row 2 continues from position 10
    one_by_one = torch.stack([model.extend(first, caches[0], slot=0), model.extend(second[10:], caches[0], 2, 10),
                              model.extend(first[:1], caches[0], slot=1)])
    segments = [Segment(0, 0, len(first)), Segment(2, 10, len(second) - 10), Segment(1, 0, 1)]
    batched = model.extend_batch(torch.cat([first, second[10:], first[:1]]), caches[1], segments)
    assert torch.allclose(batched, one_by_one, atol=1e-4), (batched - one_by_one).abs().max()
    for row, length in enumerate((len(first), 1, len(second))):
        for got, want in zip(caches[1].read(5, row, length), caches[0].read(5, row, length)):
            assert torch.allclose(got, want, atol=1e-4)


def test_same_greedy_output_in_fewer_steps(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer) -> None:
    """A constrained request next to an unconstrained one: both identical with and without fast-forward."""
    specs = [("Describe a person as JSON.", True, greedy(tokenizer)),
             ("Write one sentence about the sea.", False, greedy(tokenizer, max_tokens=20))]
    plain, plain_steps = run_engine(stored_model_dir, ll_tokenizer, tokenizer, False, specs)
    fast, fast_steps = run_engine(stored_model_dir, ll_tokenizer, tokenizer, True, specs)
    assert fast == plain
    tokens, reason, _ = fast[0]
    assert reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
    assert fast_steps < plain_steps and plain_steps == len(tokens) + 1  # + the step that samples EOS


def test_overlapped_steps_give_the_same_output(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer) -> None:
    """With each step's next decode queued before its tokens are read, the forced tokens a grammar
    adds after a sampled one are fed by `extend` a step later: constrained (with and without
    fast-forward) and unconstrained outputs and step counts are unchanged, logprobs up to float
    rounding (a finished row is decoded once more, so some steps run a larger batch)."""
    specs = [("Describe a person as JSON.", True, greedy(tokenizer, logprobs=1)),
             ("Describe a person as JSON.", True, greedy(tokenizer, max_tokens=9)),
             ("Write one sentence about the sea.", False, greedy(tokenizer, max_tokens=12))]
    for fast_forward in (False, True):
        plain = run_engine(stored_model_dir, ll_tokenizer, tokenizer, fast_forward, specs)
        overlapped = run_engine(stored_model_dir, ll_tokenizer, tokenizer, fast_forward, specs, overlap_steps=True)
        assert [result[:2] for result in overlapped[0]] == [result[:2] for result in plain[0]]
        assert overlapped[1] == plain[1]
        assert [lp.logprob for lp in overlapped[0][0][2]] == pytest.approx([lp.logprob for lp in plain[0][0][2]],
                                                                           abs=1e-4)
        assert plain[0][0][1] == "stop" and plain[0][1][1] == "length"


def test_chunked_prompts_fast_forward_to_the_same_output(stored_model_dir: Path, ll_tokenizer,
                                                         tokenizer: Tokenizer) -> None:
    """Prompts prefilled 8 tokens a step: the forced `{"name` rides on the last chunk, and the
    constrained and unconstrained outputs (with processed logprobs) are those of whole prompts."""
    specs = [("Describe a person as JSON.", True, greedy(tokenizer, logprobs=1, logprobs_mode="processed_logprobs")),
             ("Write one sentence about the sea.", False, greedy(tokenizer, max_tokens=12))]
    whole, _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, True, specs)
    chunked, _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, True, specs, prefill_chunk_tokens=8)
    assert [(tokens, reason) for tokens, reason, _ in chunked] == [(tokens, reason) for tokens, reason, _ in whole]
    assert [lp.top[0][0] for lp in chunked[0][2]] == [lp.top[0][0] for lp in whole[0][2]]
    assert chunked[0][1] == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(chunked[0][0])), SCHEMA)


def test_forced_runs_stop_at_max_tokens(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer) -> None:
    """`{"name` is forced before anything is sampled: with max_tokens 1 and 3 the run is cut short."""
    for max_tokens in (1, 3):
        specs = [("Describe a person as JSON.", True, greedy(tokenizer, max_tokens=max_tokens))]
        (plain,), _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, False, specs)
        (fast,), _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, True, specs)
        assert fast == plain
        assert fast[1] == "length" and len(fast[0]) == max_tokens


def test_a_forced_stop_token_ends_the_request_with_stop(stored_model_dir: Path, ll_tokenizer,
                                                        tokenizer: Tokenizer) -> None:
    """`name` of the forced `{"name` is a stop token here: the output is `{"`, finish_reason stop."""
    name_token = tokenizer.encode('{"name')[-1]
    sampling = greedy(tokenizer, stop_token_ids=tokenizer.eos_token_ids | {name_token})
    specs = [("Describe a person as JSON.", True, sampling)]
    (plain,), _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, False, specs)
    (fast,), _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, True, specs)
    assert fast == plain
    assert tokenizer.decode(fast[0]) == '{"' and fast[1] == "stop"


def test_forced_tokens_have_processed_logprob_zero(stored_model_dir: Path, ll_tokenizer,
                                                   tokenizer: Tokenizer) -> None:
    sampling = greedy(tokenizer, logprobs=2, logprobs_mode="processed_logprobs")
    (plain,), _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, False,
                             [("Describe a person as JSON.", True, sampling)])
    (fast,), _ = run_engine(stored_model_dir, ll_tokenizer, tokenizer, True,
                            [("Describe a person as JSON.", True, sampling)])
    assert fast[0] == plain[0] and len(fast[2]) == len(fast[0])
    forced = [lp.top == ((token, 0.0),) for token, lp in zip(fast[0], fast[2])]
    assert any(forced) and all(lp.logprob == 0.0 for lp, was_forced in zip(fast[2], forced) if was_forced)
    for plain_lp, fast_lp, was_forced in zip(plain[2], fast[2], forced):  # sampled tokens: as before
        if not was_forced:
            assert fast_lp.logprob == pytest.approx(plain_lp.logprob, abs=1e-3)
            assert [token for token, _ in fast_lp.top] == [token for token, _ in plain_lp.top]


def test_post_processor_commits_and_returns_the_forced_run() -> None:
    byte_tokenizer = llguidance.LLTokenizer("byte")
    processor = MaskPostProcessor(byte_tokenizer, max_batch_size=1)
    compiler = GrammarCompiler(byte_tokenizer)
    try:
        compiled = asyncio.run(compiler.compile(llguidance.LLMatcher.grammar_from_regex("ab(cd|ce)f")))
        assert compiled.start_forced == (ord("a"), ord("b"), ord("c"))  # found once, at compile
        constraint = compiler.new_constraint(compiled)
        assert processor.commit_with_forced(constraint, None, limit=1) == [ord("a")]  # cut to the limit
        assert processor.commit_with_forced(constraint, None, limit=5) == [ord("b"), ord("c")]
        assert processor.commit_with_forced(constraint, ord("e"), limit=5) == [ord("f")]
        assert constraint.matcher.is_accepting() and constraint.error is None
        rejected = compiler.new_constraint(compiled)
        assert processor.commit_with_forced(rejected, ord("z"), limit=5) == []
        assert rejected.error is not None
    finally:
        compiler.close()


def test_a_forced_stop_token_is_left_to_be_sampled() -> None:
    byte_tokenizer = llguidance.LLTokenizer("byte")
    processor = MaskPostProcessor(byte_tokenizer, max_batch_size=1)
    compiler = GrammarCompiler(byte_tokenizer)
    try:
        constraint = compiler.new_constraint(asyncio.run(compiler.compile(
            llguidance.LLMatcher.grammar_from_regex("abcd"))))
        assert processor.commit_with_forced(constraint, None, 5, frozenset({ord("c")})) == [ord("a"), ord("b")]
        assert constraint.matcher.consume_token(ord("c"))  # the stop token was not consumed with the run
    finally:
        compiler.close()
