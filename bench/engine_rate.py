"""Decode rate of the embedded engine, shared by the CPU and GPU engine benchmarks."""

from __future__ import annotations

import asyncio
import time

from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.torch_engine import TorchEngine


async def decode_tokens_per_s(engine: TorchEngine, prompts: list[list[int]], tokens: int, tag: str) -> float:
    """Greedy decode tokens/s over all requests, from the last first token to the last delta (prefill excluded)."""
    first: list[float] = []

    async def one(i: int, prompt: list[int]) -> int:
        request = GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0))
        count = 0
        async for delta in engine.generate(request):
            if count == 0:
                first.append(time.perf_counter())
            count += len(delta.token_ids)
        return count

    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    end = time.perf_counter()
    assert counts == [tokens] * len(prompts), counts
    return (sum(counts) - len(prompts)) / (end - max(first))
