"""The embedded PyTorch engine on the real default model: numerics against transformers,
continuous batching, seeds, abort, cache growth. Runs on CPU (and CUDA when present)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from llgtrt_core.engine.interface import EngineError, GenerationRequest, SamplingParams
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.torch_engine import TorchEngine, TorchEngineConfig
from llgtrt_core.models.loader import load_model

EOS = frozenset({2})  # <|im_end|> of SmolLM2


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
                    torch.device("cpu"))
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    generated: list[int] = []
    logits = model.prefill(torch.tensor(prompt), cache, slot=1)
    for _ in range(6):  # greedy decode in slot 1 while slot 0 holds garbage: slots must not leak
        generated.append(int(logits.argmax()))
        position = len(prompt) + len(generated) - 1
        logits = model.decode(torch.tensor([0, generated[-1]]), torch.tensor([0, position]), position + 1, cache)[1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + generated])).logits[0, -1]
    assert torch.allclose(logits, expected, atol=1e-3), (logits - expected).abs().max()
    assert tokenizer.decode(generated).startswith("The capital of France")


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
def engine_factory(stored_model_dir: Path):
    def make(**config) -> TorchEngine:
        return TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", **config))

    return make


def test_continuous_batching_matches_running_alone(engine_factory, tokenizer) -> None:
    """Requests that join and leave mid-flight (batch 2, five requests) give the tokens they give alone."""

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
        engine = engine_factory(max_batch_size=2)
        await engine.start()
        try:
            together = await asyncio.gather(*(run(engine, request(i, *s)) for i, s in enumerate(specs)))
            alone = [await run(engine, request(i, *s)) for i, s in enumerate(specs)]
            return together, alone, engine.num_active
        finally:
            await engine.shutdown()

    together, alone, active = asyncio.run(scenario())
    assert together == alone
    assert [reason for _, reason in together][2] == "length"
    assert len(together[2][0]) == 3
    assert together[0][1] == "stop"  # the greedy answer ends with EOS, which is not emitted
    assert 2 not in together[0][0]
    assert active == 0


def test_abort_frees_the_slot_and_cache_grows(engine_factory, tokenizer) -> None:
    async def scenario():
        engine = engine_factory(max_batch_size=1)
        await engine.start()
        try:
            long = GenerationRequest("long", chat_prompt(tokenizer, "Tell me a long story."),
                                     SamplingParams(max_tokens=400, temperature=0.0))
            stream = engine.generate(long)
            async for _ in stream:
                break
            await stream.aclose()  # the consumer goes away: the engine must abort it
            # With one slot, this only runs if the aborted request left it.
            short = GenerationRequest("short", list(range(300, 600)), SamplingParams(max_tokens=2, temperature=0.0))
            tokens, reason = await asyncio.wait_for(run(engine, short), timeout=60)
            return tokens, reason, engine.num_active, engine.cache.capacity
        finally:
            await engine.shutdown()

    tokens, reason, active, capacity = asyncio.run(scenario())
    assert (len(tokens), reason, active) == (2, "length", 0)
    assert capacity >= 302  # grew past its initial 256 positions for the 300-token prompt


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
