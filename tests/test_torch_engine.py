"""The embedded PyTorch engine on the real default model: numerics against transformers,
continuous batching, seeds, abort, cache growth. Runs on CPU (and CUDA when present)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import pytest
import torch

from llgtrt_core.engine.interface import EngineError, GenerationRequest, SamplingParams
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.torch_engine import TorchEngine, TorchEngineConfig
from llgtrt_core.models.loader import load_model

EOS = frozenset({2})  # <|im_end|> of SmolLM2
# These tests compare runs batched differently token for token. On the CPU the default (int4
# weights, bfloat16 activations) rounds each matmul's output to bfloat16, and a batch of another
# size may round one value the other way and flip a greedy near-tie; float32 does not. The quantized
# default has its own tests (test_quantized_weights.py).
BATCH_EXACT_CPU = {"dtype": "float32"}


@pytest.fixture(scope="module")
def tokenizer(stored_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stored_model_dir)


def chat_prompt(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_logits_match_transformers(stored_model_dir: Path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(stored_model_dir, dtype=torch.float32).eval()
    model = load_model(stored_model_dir, 512, torch.float32, torch.device("cpu"))
    config = model.config
    cache = KVCache(config.num_layers, 2, config.num_kv_heads, config.head_dim, 512, torch.float32,
                    torch.device("cpu"), block_size=4)
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    assert cache.allocate(0, 1) and cache.allocate(1, len(prompt) + 6)
    cache.sync_table()
    generated: list[int] = []
    logits = model.extend(torch.tensor(prompt), cache, slot=1)
    for _ in range(6):  # greedy decode in row 1 while row 0 holds garbage: rows must not leak
        generated.append(int(logits.argmax()))
        position = len(prompt) + len(generated) - 1
        logits = model.decode(torch.tensor([0, generated[-1]]), torch.tensor([0, position]), position + 1, cache,
                              cache.block_table[:2])[1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + generated])).logits[0, -1]
    assert torch.allclose(logits, expected, atol=1e-3), (logits - expected).abs().max()
    assert tokenizer.decode(generated).startswith("The capital of France")


def assert_logprobs_match(got: list, want: list) -> None:
    """Same chosen-token logprobs (float32 batching noise allowed) and the same top alternatives."""
    assert len(got) == len(want)
    for got_logprob, want_logprob in zip(got, want):
        assert got_logprob.logprob == pytest.approx(want_logprob.logprob, abs=1e-3)
        assert [t for t, _ in got_logprob.top] == [t for t, _ in want_logprob.top]


def run(engine: TorchEngine, request: GenerationRequest) -> tuple[list[int], str]:
    async def collect() -> tuple[list[int], str]:
        tokens: list[int] = []
        reason = None
        async for delta in engine.generate(request):
            tokens += delta.token_ids
            reason = delta.finish_reason
        return tokens, reason

    return collect()


@pytest.fixture(scope="module")
def ll_tokenizer(stored_model_dir: Path, tokenizer):
    from llgtrt_core.constraints import build_ll_tokenizer

    vocab_size = json.loads((stored_model_dir / "config.json").read_text())["vocab_size"]
    return build_ll_tokenizer(tokenizer, vocab_size, sorted(EOS))


@pytest.fixture(scope="module")
def engine_factory(stored_model_dir: Path, ll_tokenizer):
    """Engines on cpu unless told; constrained=True attaches the llguidance mask post-processor."""
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor

    def make(constrained: bool = False, **config) -> TorchEngine:
        config = TorchEngineConfig(**{"device": "cpu", "cpu_compile": False, **config})
        post_processor = MaskPostProcessor(ll_tokenizer, max_batch_size=config.max_batch_size) if constrained else None
        return TorchEngine(stored_model_dir, config, post_processor)

    return make


@pytest.mark.parametrize("overlap_steps", [False, True])
def test_continuous_batching_matches_running_alone(engine_factory, tokenizer, overlap_steps: bool) -> None:
    """Requests that join and leave mid-flight (batch 2, five requests) give the tokens they give
    alone, also when each step's next decode is queued before its tokens are read (overlap_steps:
    rows that finish were decoded once more, and the rows behind them move into their slots)."""

    def request(i: int, question: str, max_tokens: int, sampling: dict) -> GenerationRequest:
        return GenerationRequest(f"r{i}", chat_prompt(tokenizer, question),
                                 SamplingParams(max_tokens=max_tokens, stop_token_ids=EOS, **sampling))

    specs = [
        ("What is the capital of France?", 12, {"temperature": 0.0}),
        ("Write a haiku about the sea.", 20, {"temperature": 0.0}),
        ("Count to five.", 3, {"temperature": 0.0}),
        ("Write a haiku about the sea.", 16, {"temperature": 0.9, "seed": 11}),
        ("Name a color.", 9, {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 5}),
    ]

    async def scenario():
        engine = engine_factory(**BATCH_EXACT_CPU, max_batch_size=2, overlap_steps=overlap_steps)
        await engine.start()
        try:
            together = await asyncio.gather(*(run(engine, request(i, *s)) for i, s in enumerate(specs)))
            mixed = engine.runner.num_mixed_steps
            alone = [await run(engine, request(i, *s)) for i, s in enumerate(specs)]
            return together, alone, engine.num_active, mixed
        finally:
            await engine.shutdown()

    together, alone, active, mixed = asyncio.run(scenario())
    assert together == alone
    assert mixed > 0  # requests joined while others decoded: those steps ran in one pass
    assert [reason for _, reason in together][2] == "length"
    assert len(together[2][0]) == 3
    assert together[0][1] == "stop"  # the greedy answer ends with EOS, which is not emitted
    assert 2 not in together[0][0]
    assert active == 0


@pytest.mark.parametrize("overlap_steps", [False, True])
def test_abort_frees_the_slot_and_cache_grows(engine_factory, tokenizer, overlap_steps: bool) -> None:
    async def scenario():
        engine = engine_factory(max_batch_size=1, overlap_steps=overlap_steps)
        await engine.start()
        try:
            initial_blocks = engine.cache.num_blocks
            long = GenerationRequest("long", chat_prompt(tokenizer, "Tell me a long story."),
                                     SamplingParams(max_tokens=400, temperature=0.0))
            stream = engine.generate(long)
            async for _ in stream:
                break
            await stream.aclose()  # the consumer goes away: the engine must abort it
            # With one slot, this only runs if the aborted request left it.
            short = GenerationRequest("short", list(range(300, 1400)), SamplingParams(max_tokens=2, temperature=0.0))
            tokens, reason = await asyncio.wait_for(run(engine, short), timeout=120)
            return tokens, reason, engine.num_active, initial_blocks, engine.cache
        finally:
            await engine.shutdown()

    tokens, reason, active, initial_blocks, cache = asyncio.run(scenario())
    assert (len(tokens), reason, active) == (2, "length", 0)
    # The pool grew for the 1,100-token prompt, and every block came back.
    assert initial_blocks * cache.block_size < 1100 <= (cache.num_blocks - 1) * cache.block_size
    assert cache.usage == 0


@pytest.mark.parametrize(("overlap_steps", "chunk"), [(False, None), (True, 8)])
def test_preempted_sequences_give_the_tokens_they_give_alone(engine_factory, tokenizer, overlap_steps: bool,
                                                             chunk: Optional[int]) -> None:
    """Four requests of ~100 positions each share a KV cache of 192 tokens: as they grow, the
    newest are preempted and later recomputed. Each still gets exactly the tokens it gets alone
    (none lost, none sent twice), penalties and seeded draws included."""

    def request(i: int, question: str, sampling: dict) -> GenerationRequest:
        return GenerationRequest(f"r{i}", chat_prompt(tokenizer, question),
                                 SamplingParams(max_tokens=64, stop_token_ids=EOS, **sampling))

    specs = [
        ("Tell me a long story about a dragon.", {"temperature": 0.0}),
        ("Write a poem about the sea.", {"temperature": 0.8, "seed": 3, "frequency_penalty": 0.5}),
        ("Explain how rain forms.", {"temperature": 0.0, "repetition_penalty": 1.2, "logprobs": 2}),
        ("List ten fruits.", {"temperature": 0.7, "top_p": 0.9, "seed": 8, "prompt_logprobs": 1}),
    ]

    async def scenario():
        engine = engine_factory(**BATCH_EXACT_CPU, max_batch_size=4, max_model_len=192, kv_cache_max_tokens=192,
                                overlap_steps=overlap_steps, prefill_chunk_tokens=chunk)
        await engine.start()
        try:
            together = await asyncio.gather(*(run(engine, request(i, *s)) for i, s in enumerate(specs)))
            preemptions = engine.num_preemptions
            alone = [await run(engine, request(i, *s)) for i, s in enumerate(specs)]
            return together, alone, preemptions, engine.num_preemptions, engine.cache.usage
        finally:
            await engine.shutdown()

    together, alone, preemptions, preemptions_after, usage = asyncio.run(scenario())
    assert preemptions > 0 and preemptions_after == preemptions  # alone, each fits
    assert together == alone
    held = sum(len(request(i, *spec).prompt_token_ids) + len(tokens) for i, (spec, (tokens, _)) in
               enumerate(zip(specs, together)))
    assert held > 192 * 1.5, held  # far more than the cache: they could not all run at once
    assert usage == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_preemption_keeps_constrained_outputs_and_logprobs(engine_factory, ll_tokenizer, tokenizer,
                                                           device: str) -> None:
    """Six requests of up to ~100 positions share a 112-token cache, with overlapped steps and
    prompts prefilled 8 tokens a step: JSON-schema requests whose grammar forces tokens (fed a
    step later; on CPU) or whose sampled token is committed a step later (raw logprobs, or CUDA
    graphs: no fast-forward), prompt logprobs, seeded draws with penalties and min_tokens.
    Preempted and recomputed, each gets the tokens, logprobs and prompt logprobs it gets alone
    (none lost, none sent twice)."""
    from llgtrt_core.constraints import GrammarCompiler
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"},
                                               "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]}},
              "required": ["name", "age", "city"], "additionalProperties": False}

    def sampling(**extra) -> SamplingParams:
        return SamplingParams(**{"max_tokens": 80, "temperature": 0.0, "stop_token_ids": EOS, **extra})

    specs = [  # question, constrained, sampling
        ("Describe a person as JSON.", True, sampling(logprobs=1)),
        ("Tell me a long story about a dragon.", False, sampling(logprobs=2, prompt_logprobs=1, min_tokens=70,
                                                                 frequency_penalty=0.5)),
        ("Describe a person from Paris as JSON.", True, sampling(prompt_logprobs=1)),
        ("Write a poem about the sea.", False, sampling(temperature=0.8, seed=3, frequency_penalty=0.5,
                                                        min_tokens=70)),
        ("Describe a person from London as JSON.", True, sampling(logprobs=1, logprobs_mode="raw_logprobs")),
        ("Describe a person from Berlin as JSON.", True, sampling(temperature=0.7, seed=5, max_tokens=40)),
    ]

    async def scenario():
        compiler = GrammarCompiler(ll_tokenizer)
        engine = engine_factory(constrained=True, device=device, dtype="float32", max_batch_size=4,
                                max_model_len=112, kv_cache_max_tokens=112, overlap_steps=True, prefill_chunk_tokens=8)
        await engine.start()
        try:
            grammar = await compiler.compile(json_schema_grammar(schema))

            async def one(i: int, question: str, constrained: bool, params: SamplingParams) -> tuple:
                request = GenerationRequest(f"r{i}", chat_prompt(tokenizer, question), params,
                                            compiler.new_constraint(grammar) if constrained else None)
                deltas = [delta async for delta in engine.generate(request)]
                return ([t for d in deltas for t in d.token_ids], deltas[-1].finish_reason,
                        [lp for d in deltas for lp in d.logprobs or []],
                        [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None])

            together = await asyncio.gather(*(one(i, *spec) for i, spec in enumerate(specs)))
            preemptions = engine.num_preemptions
            alone = [await one(i, *spec) for i, spec in enumerate(specs)]
            return together, alone, preemptions, engine.cache.usage
        finally:
            await engine.shutdown()
            compiler.close()

    together, alone, preemptions, usage = asyncio.run(scenario())
    assert preemptions > 0 and usage == 0
    assert [result[:2] for result in together] == [result[:2] for result in alone]
    for got_result, want_result in zip(together, alone):
        # Sampled tokens' logprobs, then the prompt's (sent once, with the first delta; the first is None).
        got, want = ([*logprobs, *(p for sent in prompt_logprobs for p in sent[1:])]
                     for _, _, logprobs, prompt_logprobs in (got_result, want_result))
        assert len(got) == len(want) and len(got_result[3]) == len(want_result[3]) <= 1
        assert_logprobs_match(got, want)
    prompt_lengths = [len(chat_prompt(tokenizer, question)) for question, _, _ in specs]
    assert [len(result[2]) for result in together] == [len(together[0][0]), len(together[1][0]), 0, 0,
                                                       len(together[4][0]), 0]
    assert [len(sum(result[3], [])) for result in together] == [0, prompt_lengths[1], prompt_lengths[2], 0, 0, 0]


def test_a_prompt_preempted_mid_prefill_scores_its_prompt_once(engine_factory, ll_tokenizer, tokenizer) -> None:
    """An 80-token prompt asking for prompt logprobs is prefilled 2 tokens a step beside a running
    JSON request in a 192-token cache. Admission leaves room for a token a step, but the grammar
    forces a ~75-token constant at once (fast-forward) after a sampled 40-character name, taking
    the blocks back from the part-prefilled prompt, which later starts over. Its prompt logprobs,
    one per prompt token, and both requests' tokens are those they get alone."""
    from llgtrt_core.constraints import GrammarCompiler
    from llgtrt_core.constraints.request_grammar import json_schema_grammar

    constant = "The quick brown fox jumps over the lazy dog near the river bank. " * 5
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 40, "maxLength": 40},
                                               "motto": {"const": constant}},
              "required": ["name", "motto"], "additionalProperties": False}
    prompt = chat_prompt(tokenizer, "Summarize: " + "the fox and the dog by the river, " * 5)

    async def scenario():
        compiler = GrammarCompiler(ll_tokenizer)
        engine = engine_factory(**BATCH_EXACT_CPU, constrained=True, max_batch_size=2, max_model_len=192,
                                kv_cache_max_tokens=192, overlap_steps=True, prefill_chunk_tokens=2)
        await engine.start()
        try:
            grammar = await compiler.compile(json_schema_grammar(schema))

            async def collect(name: str) -> tuple[list[int], list]:
                if name == "json":
                    request = GenerationRequest(name, chat_prompt(tokenizer, "A person as JSON."),
                                                SamplingParams(max_tokens=150, temperature=0.0, stop_token_ids=EOS),
                                                compiler.new_constraint(grammar))
                else:
                    request = GenerationRequest(name, prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                                             prompt_logprobs=1))
                tokens, prompt_logprobs = [], []
                async for delta in engine.generate(request):
                    tokens += delta.token_ids
                    prompt_logprobs += delta.prompt_logprobs or []
                return tokens, prompt_logprobs

            together = await asyncio.gather(collect("json"), _after_steps(engine, 2, collect("scored")))
            preemptions = engine.num_preemptions
            alone = [await collect(name) for name in ("json", "scored")]
            return together, alone, preemptions, engine.cache.usage
        finally:
            await engine.shutdown()
            compiler.close()

    together, alone, preemptions, usage = asyncio.run(scenario())
    assert preemptions > 0 and usage == 0
    assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]
    assert constant in tokenizer.decode(together[0][0])
    (_, got), (_, want) = together[1], alone[1]
    assert len(got) == len(prompt) and got[0] is None
    assert_logprobs_match(got[1:], want[1:])


async def _after_steps(engine: TorchEngine, steps: int, awaitable):
    """`awaitable`, started once the engine has run `steps` steps (so another request runs first)."""
    while engine.num_steps < steps:
        await asyncio.sleep(0.001)
    return await awaitable


def test_prompts_split_over_prefill_passes_match_running_alone(engine_factory, tokenizer, monkeypatch) -> None:
    """A step's prompts share forward passes up to PREFILL_PASS_TOKENS (here 40): some passes hold
    two prompts, a longer one runs alone; every request still gets the tokens it gets alone."""
    import llgtrt_core.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "PREFILL_PASS_TOKENS", 40)
    lengths = [10, 14, 50, 12]  # passes [10, 14], [50] (over the budget: alone), [12]
    requests = [GenerationRequest(f"p{i}", list(range(300 + i, 300 + i + n)),
                                  SamplingParams(max_tokens=4, temperature=0.0)) for i, n in enumerate(lengths)]

    async def scenario():
        engine = engine_factory(**BATCH_EXACT_CPU, max_batch_size=4)
        await engine.start()
        try:
            together = await asyncio.gather(*(run(engine, r) for r in requests))
            alone = [await run(engine, r) for r in requests]
            return together, alone
        finally:
            await engine.shutdown()

    together, alone = asyncio.run(scenario())
    assert together == alone
    assert all(len(tokens) == 4 for tokens, _ in together)


def test_rejects_prompts_that_do_not_fit(engine_factory) -> None:
    async def scenario():
        engine = engine_factory(max_batch_size=1, max_model_len=64)
        await engine.start()
        try:
            with pytest.raises(EngineError, match="context"):
                await run(engine, GenerationRequest("x", list(range(64)), SamplingParams(max_tokens=4)))
            tokens, reason = await run(engine, GenerationRequest("y", list(range(60)),
                                                                 SamplingParams(max_tokens=50, temperature=0.0)))
            return tokens, reason
        finally:
            await engine.shutdown()

    tokens, reason = asyncio.run(scenario())
    assert reason == "length" and len(tokens) == 4  # the context (64) ends it before max_tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_chunked_prefill_matches_whole_prompts_while_others_stream(engine_factory, tokenizer, device: str) -> None:
    """Prompts prefilled 16 tokens a step give the greedy tokens (and prompt logprobs) of whole-
    prompt prefill. The short request ends while the next prompt is mid-prefill (in the cache's
    prefill row, which the leaving row does not disturb); the long prompt is prefilled over 8
    steps while another request streams (on CUDA: decoding under graphs throughout)."""
    specs = [
        ("a", chat_prompt(tokenizer, "Count to five."), 2, None),
        ("b", chat_prompt(tokenizer, "Write a haiku about the sea."), 24, 2),
        ("c", list(range(300, 428)), 6, None),
    ]
    requests = [GenerationRequest(name, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               stop_token_ids=EOS, prompt_logprobs=top))
                for name, prompt, max_tokens, top in specs]

    async def scenario(chunk: int) -> tuple[list, list[str]]:
        engine = engine_factory(max_batch_size=3, prefill_chunk_tokens=chunk, device=device, dtype="float32")
        await engine.start()
        arrivals: list[str] = []  # which request each delta went to, in order

        async def collect(request: GenerationRequest) -> tuple[list[int], str, list]:
            tokens, reason, prompt_logprobs = [], None, None
            async for delta in engine.generate(request):
                arrivals.append(request.request_id)
                tokens += delta.token_ids
                reason = delta.finish_reason
                prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
            return tokens, reason, prompt_logprobs

        try:
            return list(await asyncio.gather(*(collect(r) for r in requests))), arrivals
        finally:
            await engine.shutdown()

    chunked, arrivals = asyncio.run(scenario(16))
    whole, _ = asyncio.run(scenario(0))
    assert [(tokens, reason) for tokens, reason, _ in chunked] == [(tokens, reason) for tokens, reason, _ in whole]
    assert [len(t) for t, _, _ in chunked] == [2, 24, 6]
    chunked_scores, whole_scores = chunked[1][2], whole[1][2]
    assert len(chunked_scores) == len(specs[1][1]) and chunked_scores[0] is None
    assert_logprobs_match(chunked_scores[1:], whole_scores[1:])
    # "b" streamed while "c" (128 tokens: 8 chunks) was prefilled behind it.
    assert arrivals[:arrivals.index("c")].count("b") >= 5


def test_abort_mid_prefill_frees_the_slot(engine_factory, tokenizer) -> None:
    async def scenario():
        engine = engine_factory(max_batch_size=1, prefill_chunk_tokens=4)
        await engine.start()
        try:
            long = GenerationRequest("long", list(range(300, 1300)), SamplingParams(max_tokens=400, temperature=0.0))
            deltas = []

            async def consume() -> None:
                async for delta in engine.generate(long):
                    deltas.append(delta)

            task = asyncio.create_task(consume())
            while engine.num_steps < 3:  # a few of its 250 chunks have run
                await asyncio.sleep(0.005)
            task.cancel()  # the consumer goes away mid-prefill: the engine must abort it
            aborted_at = engine.num_steps
            short = GenerationRequest("short", chat_prompt(tokenizer, "Name a color."),
                                      SamplingParams(max_tokens=3, temperature=0.0))
            first = await asyncio.wait_for(run(engine, short), timeout=60)  # one slot: only if it was freed
            again = await run(engine, short)
            return deltas, aborted_at, engine.num_steps, first, again, engine.num_active
        finally:
            await engine.shutdown()

    deltas, aborted_at, steps, first, again, active = asyncio.run(scenario())
    assert deltas == [] and aborted_at < 250
    assert steps < aborted_at + 50  # the short request did not wait for the long prompt's chunks
    assert first == again and first[1] == "length" and active == 0


class NotAGrammar:
    """A constraint the mask post-processor cannot fill (it has no llguidance matcher)."""

    error = None


def test_a_failing_mask_fill_ends_only_its_rows(stored_model_dir: Path, tokenizer) -> None:
    from llguidance import LLTokenizer

    from llgtrt_core.constraints.postprocessor import MaskPostProcessor

    async def scenario():
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", max_batch_size=2, fast_forward=False,
                                                                 **BATCH_EXACT_CPU),
                             MaskPostProcessor(LLTokenizer("byte"), max_batch_size=2))
        await engine.start()
        try:
            plain = GenerationRequest("plain", chat_prompt(tokenizer, "Name a color."),
                                      SamplingParams(max_tokens=6, temperature=0.0))
            broken = GenerationRequest("broken", chat_prompt(tokenizer, "Count to five."),
                                       SamplingParams(max_tokens=6, temperature=0.0), NotAGrammar())
            together = await asyncio.gather(run(engine, plain), run(engine, broken))
            return together, await run(engine, plain)
        finally:
            await engine.shutdown()

    (plain, broken), alone = asyncio.run(scenario())
    assert broken == ([], "error")
    assert plain == alone and plain[1] == "length" and len(plain[0]) == 6


def test_a_request_whose_admission_fails_gets_an_error(stored_model_dir: Path, tokenizer) -> None:
    """Admission asks the grammar for its forced tokens, which raises for this constraint: the
    failed step must end that request (not lose it between the queue and the batch), and the
    engine serves the next one."""
    from llguidance import LLTokenizer

    from llgtrt_core.constraints.postprocessor import MaskPostProcessor

    async def scenario():
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", max_batch_size=2, cpu_compile=False),
                             MaskPostProcessor(LLTokenizer("byte"), max_batch_size=2))
        await engine.start()
        try:
            broken = GenerationRequest("broken", chat_prompt(tokenizer, "Count to five."),
                                       SamplingParams(max_tokens=6, temperature=0.0), NotAGrammar())
            plain = GenerationRequest("plain", chat_prompt(tokenizer, "Name a color."),
                                      SamplingParams(max_tokens=6, temperature=0.0))
            return await asyncio.wait_for(run(engine, broken), timeout=60), await run(engine, plain)
        finally:
            await engine.shutdown()

    broken, plain = asyncio.run(scenario())
    assert broken == ([], "error")
    assert plain[1] == "length" and len(plain[0]) == 6


def test_a_consumer_that_falls_behind_gets_its_backlog_in_one_delta(engine_factory, tokenizer) -> None:
    """Deltas waiting in the queue are merged (the HTTP layer then sends one chunk for them): the same
    tokens as a consumer that keeps up, in fewer deltas, the finish reason on the last."""
    request = GenerationRequest("lag", chat_prompt(tokenizer, "Count from one to ten."),
                                SamplingParams(max_tokens=12, temperature=0.0))

    async def scenario() -> tuple[list[list[int]], list[list[int]], list]:
        engine = engine_factory(max_batch_size=1)
        await engine.start()
        try:
            kept_up = [delta.token_ids async for delta in engine.generate(request)]
            lagging, reasons = [], []
            async for delta in engine.generate(GenerationRequest("lag2", request.prompt_token_ids,
                                                                 request.sampling)):
                await asyncio.sleep(0.4 if not lagging else 0)  # the engine runs ahead meanwhile
                lagging.append(delta.token_ids)
                reasons.append(delta.finish_reason)
            return kept_up, lagging, reasons
        finally:
            await engine.shutdown()

    kept_up, lagging, reasons = asyncio.run(scenario())
    assert sum(lagging, []) == sum(kept_up, [])
    assert len(sum(kept_up, [])) == 12
    assert len(lagging) < len(kept_up)
    assert any(len(tokens) > 1 for tokens in lagging)
    assert reasons[-1] == "length" and all(reason is None for reason in reasons[:-1])


def test_step_log_writes_one_line_per_step(engine_factory, tokenizer, monkeypatch, tmp_path: Path) -> None:
    """LLGTRT_STEP_LOG: each step's line says what it ran (the prompt's prefill, then one decode row
    a step) and its phases' wall ms."""
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LLGTRT_STEP_LOG", str(log))
    prompt = chat_prompt(tokenizer, "Name a color.")

    async def scenario():
        engine = engine_factory(max_batch_size=1)
        await engine.start()
        try:
            request = GenerationRequest("r", prompt, SamplingParams(max_tokens=4, temperature=0.0))
            return await asyncio.wait_for(run(engine, request), timeout=120), engine.num_steps
        finally:
            await engine.shutdown()

    (tokens, _), steps = asyncio.run(scenario())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, steps + 1)) and len(tokens) == 4
    assert (lines[0]["prefill"], lines[0]["admitted"], lines[0]["decode"]) == (len(prompt), 1, 0)
    assert all(line["decode"] == 1 and line["prefill"] == 0 for line in lines[1:])
    assert all(line["ms"]["forward"] > 0 for line in lines)
    # What stalls a whole step: the collector's pauses, the OS taking the engine thread's core.
    assert all(line["gc_ms"] >= 0 for line in lines) and all(line["preempted"] >= 0 for line in lines[1:])
