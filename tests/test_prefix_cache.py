"""Prefix caching in the embedded engine (engine/block_manager.py wired into the engine) on the real
default model: a cached prefix gives the tokens and logprobs a full prefill gives, requests running
at once share it, eviction under memory pressure, and `cached_tokens` in the API's usage."""

from __future__ import annotations

import asyncio
import os
from typing import Optional

import httpx
import pytest
import torch

from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.torch_engine import TorchEngine
from test_torch_engine import (BATCH_EXACT_CPU, EOS, assert_logprobs_match, engine_factory,  # noqa: F401
                               ll_tokenizer, tokenizer)

SYSTEM = ("You are the support assistant of a bicycle shop. You answer questions about repairs, opening hours, "
          "prices and orders. Be friendly and brief. The shop opens at nine and closes at six, every day but "
          "Sunday. A tune-up costs forty euros, a new chain twenty-five. Orders ship within two days.")
QUESTIONS = ("When do you open?", "How much is a tune-up?", "Do you ship to Spain?")


def prompt(tokenizer, question: str, system: str = SYSTEM) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def collect(engine: TorchEngine, request: GenerationRequest) -> tuple[list[int], list, Optional[int], list]:
    """Tokens, their logprobs, the cached tokens reported (on the first delta) and the prompt logprobs."""
    tokens, logprobs, prompt_logprobs = [], [], []
    cached = None
    async for delta in engine.generate(request):
        if cached is None:
            cached = delta.cached_tokens
        else:
            assert delta.cached_tokens is None, "cached_tokens comes once"
        tokens += delta.token_ids
        logprobs += delta.logprobs or []
        prompt_logprobs += delta.prompt_logprobs or []
    return tokens, logprobs, cached, prompt_logprobs


def greedy(**extra) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 10, "temperature": 0.0, "stop_token_ids": EOS, "logprobs": 2, **extra})


@pytest.mark.parametrize(("device", "overlap_steps", "chunk"), [
    ("cpu", False, None), ("cpu", True, 8),
    pytest.param("cuda", None, None, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_cached_prefix_gives_what_a_full_prefill_gives(engine_factory, ll_tokenizer, tokenizer,  # noqa: F811
                                                          device: str, overlap_steps: Optional[bool],
                                                          chunk: Optional[int]) -> None:
    """Three questions after one system prompt, then a JSON-schema request (its grammar forces tokens
    after the prompt) and one asking for prompt logprobs: with the cache, each question after the first
    prefills only past the system prompt's cached blocks, and every answer has the tokens and logprobs
    of the engine without a cache; the prompt-logprobs request computes its whole prompt. On CUDA:
    float32, CUDA graphs and overlapped steps (the engine's defaults there)."""
    from llgtrt_core.constraints import GrammarCompiler
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"hours": {"type": "string", "maxLength": 12}},
              "required": ["hours"], "additionalProperties": False}
    prompts = [prompt(tokenizer, q) for q in QUESTIONS]

    async def scenario(prefix_caching: bool):
        compiler = GrammarCompiler(ll_tokenizer)
        engine = engine_factory(constrained=True, device=device, dtype="float32", prefix_caching=prefix_caching,
                                overlap_steps=overlap_steps, prefill_chunk_tokens=chunk)
        await engine.start()
        try:
            grammar = await compiler.compile(json_schema_grammar(schema))
            results = [await collect(engine, GenerationRequest(f"q{i}", p, greedy())) for i, p in enumerate(prompts)]
            results.append(await collect(engine, GenerationRequest("json", prompts[0], greedy(max_tokens=16),
                                                                   compiler.new_constraint(grammar))))
            results.append(await collect(engine, GenerationRequest("scored", prompts[1], greedy(prompt_logprobs=1))))
            return results, engine.step_stats()["prefix_cache"]
        finally:
            await engine.shutdown()
            compiler.close()

    cached_run, stats = asyncio.run(scenario(True))
    plain_run, plain_stats = asyncio.run(scenario(False))
    for (tokens, logprobs, _, prompt_logprobs), (want_tokens, want_logprobs, _, want_prompt) in zip(cached_run,
                                                                                                   plain_run):
        assert tokens == want_tokens
        assert_logprobs_match(logprobs, want_logprobs)
        assert len(prompt_logprobs) == len(want_prompt)
        assert_logprobs_match(prompt_logprobs[1:], want_prompt[1:])
    assert len(cached_run[4][3]) == len(prompts[1])
    # Whole blocks of what each prompt shares with those before it, short of its last token.
    shared = [max((len(os.path.commonprefix([p, earlier])) for earlier in prompts[:i]), default=0)
              for i, p in enumerate(prompts)]
    cached = [result[2] for result in cached_run]
    assert cached[:3] == [min(n, len(p) - 1) // 16 * 16 for n, p in zip(shared, prompts)] and cached[1] >= 48
    assert cached[3] == (len(prompts[0]) - 1) // 16 * 16  # q0's whole prompt but the block of its last token
    assert cached[4] == 0  # prompt logprobs: computed, not looked up
    assert [result[2] for result in plain_run] == [0] * 5
    assert stats["hits"] == sum(cached) and stats["queries"] == sum(map(len, prompts)) + len(prompts[0])
    assert plain_stats == {"queries": 0, "hits": 0, "cached_blocks": 0, "evictions": 0}


def test_requests_running_at_once_share_their_prefix(engine_factory, tokenizer) -> None:  # noqa: F811
    """A request still generating while two others with its system prompt arrive: they take its cached
    blocks (reference counts), and each answers as it does alone without a cache."""
    prompts = [prompt(tokenizer, q) for q in QUESTIONS]
    first_request = GenerationRequest("long", prompts[0], greedy(max_tokens=40, logprobs=None, min_tokens=40))
    later = [GenerationRequest(f"q{i}", p, greedy()) for i, p in enumerate(prompts[1:], 1)]

    async def together():
        engine = engine_factory(**BATCH_EXACT_CPU, max_batch_size=4)
        await engine.start()
        try:
            events: list[str] = []
            deltas = engine.generate(first_request)
            first = await anext(deltas)  # prefilled: its prompt's full blocks are cached
            refs_while_shared = []

            async def rest_of_first():
                async for _ in deltas:
                    pass
                events.append("long done")

            async def one(request):
                tokens, logprobs, cached = [], [], None
                async for delta in engine.generate(request):
                    if cached is None:  # running: the long request's first block is held by both
                        cached = delta.cached_tokens
                        refs_while_shared.append(engine.cache.blocks._refs[engine.cache.blocks.blocks(0)[0]])
                    tokens += delta.token_ids
                    logprobs += delta.logprobs or []
                events.append(f"{request.request_id} done")
                return tokens, logprobs, cached, []

            results = await asyncio.gather(rest_of_first(), *(one(r) for r in later))
            return first.cached_tokens, results[1:], events, refs_while_shared
        finally:
            await engine.shutdown()

    async def alone():
        engine = engine_factory(**BATCH_EXACT_CPU, prefix_caching=False)
        await engine.start()
        try:
            return [await collect(engine, r) for r in later]
        finally:
            await engine.shutdown()

    first_cached, results, events, refs = asyncio.run(together())
    assert first_cached == 0 and events[-1] == "long done"  # the first request outlived the others
    assert all(cached >= 48 for _, _, cached, _ in results)
    assert max(refs) >= 2  # row 0 (the long request) shares its first block
    for (tokens, logprobs, _, _), (want_tokens, want_logprobs, _, _) in zip(results, asyncio.run(alone())):
        assert tokens == want_tokens
        assert_logprobs_match(logprobs, want_logprobs)


def test_eviction_under_memory_pressure_takes_the_least_recently_used_prefix(engine_factory, tokenizer) -> None:  # noqa: F811
    """A 128-token KV cache (8 blocks) holds one ~85-token prompt's 5 full blocks and little more:
    three prompts with different system prompts (from their first block on), one after another,
    evict the least recently used cached blocks first; a prompt whose blocks were evicted is computed
    again, and every answer stays the same."""
    systems = [SYSTEM, SYSTEM.replace("bicycle", "coffee"), SYSTEM.replace("bicycle", "book")]
    prompts = [prompt(tokenizer, QUESTIONS[0], system) for system in systems]

    async def scenario():
        engine = engine_factory(**BATCH_EXACT_CPU, max_batch_size=2, max_model_len=128, kv_cache_max_tokens=128)
        await engine.start()
        try:
            order = [0, 0, 1, 2, 2, 0]
            results = [await collect(engine, GenerationRequest(f"r{n}", prompts[i], greedy()))
                       for n, i in enumerate(order)]
            return order, results, engine.step_stats()["prefix_cache"]
        finally:
            await engine.shutdown()

    order, results, stats = asyncio.run(scenario())
    cached = [result[2] for result in results]
    full = [(len(p) - 1) // 16 * 16 for p in prompts]
    # 0 cold, then cached; 1 evicts 0's last blocks; 2 evicts the rest of 0 (least recent) and 1's last
    # blocks, then is cached; 0 again: all evicted, computed again.
    assert cached == [0, full[0], 0, 0, full[2], 0] and full[0] == 80
    assert stats["evictions"] >= 6
    for n, i in enumerate(order):
        assert results[n][0] == results[order.index(i)][0]


def test_usage_reports_cached_prompt_tokens(server, openai_client, served_model) -> None:
    """The same system prompt twice (chat, streamed chat, completions, responses): the later calls report
    the cached prompt tokens as OpenAI does, in whole 16-token blocks, fewer than the prompt; /v1/engine/stats
    counts them."""
    system = SYSTEM.replace("bicycle", "kayak")  # cold on this session's server
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
    first = openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=2, temperature=0)
    prompt_tokens = second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16 > 0
    streamed = list(openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=2,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True}))
    assert streamed[-1].usage.model_dump() == second.usage.model_dump()

    messages[1]["content"] = QUESTIONS[1]
    other = openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=2, temperature=0)
    assert 0 < other.usage.prompt_tokens_details.cached_tokens < other.usage.prompt_tokens - 16

    text = f"{system}\nQ: {QUESTIONS[0]}\nA:"
    completions = [openai_client.completions.create(model=served_model, prompt=text, max_tokens=2, temperature=0)
                   for _ in range(2)]
    assert [c.usage.prompt_tokens_details.cached_tokens for c in completions] == [
        0, (completions[1].usage.prompt_tokens - 1) // 16 * 16]

    responses = [openai_client.responses.create(model=served_model, instructions=system, input=QUESTIONS[2],
                                                max_output_tokens=16, temperature=0) for _ in range(2)]
    full = (responses[1].usage.input_tokens - 1) // 16 * 16
    # The first one shares the chat calls' system prompt (the instructions) at most.
    assert 0 < responses[0].usage.input_tokens_details.cached_tokens < full
    assert responses[1].usage.input_tokens_details.cached_tokens == full

    engine = httpx.get(f"{server}/v1/engine/stats", timeout=10).json()
    stats = engine["prefix_cache"]
    assert stats["hits"] >= second.usage.prompt_tokens_details.cached_tokens + full and stats["cached_blocks"] > 0
    assert engine["num_sit_outs"] == 0  # on a CPU constrained rows fast-forward: none is filled apart
