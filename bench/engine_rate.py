"""Decode rate of the embedded engine, shared by the CPU and GPU engine benchmarks."""

from __future__ import annotations

import asyncio
import threading
import time

from llgtrt_core.engine.interface import GenerationRequest, SamplingParams, TokenDelta
from llgtrt_core.engine.torch_engine import TorchEngine


async def decode_tokens_per_s(engine: TorchEngine, prompts: list[list[int]], tokens: int, tag: str) -> float:
    """Greedy decode tokens/s over all requests, from the last first token to the last delta (prefill
    excluded), each request read by an `engine.generate` consumer on this event loop."""
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


class DeltaCounter:
    """A `TorchEngine(deliver=...)` that only counts: each request's tokens and when its first and last
    deltas came, on the engine thread. The engine alone, as the server's engine process runs it (its
    deltas leave for the API processes), without an event loop in its process waking a consumer per
    request each step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[object, list] = {}  # route -> [tokens, first delta's time, last delta's time]
        self._done: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __call__(self, outbox: list[tuple[object, TokenDelta]]) -> None:
        now = time.perf_counter()
        with self._lock:
            for route, delta in outbox:
                counts = self._waiting[route]
                counts[0] += len(delta.token_ids)
                counts[1] = counts[1] or now
                counts[2] = now
                if delta.finish_reason is not None:
                    counts.append(delta.finish_reason)
            if all(len(counts) == 4 for counts in self._waiting.values()):
                self._loop.call_soon_threadsafe(self._done.set)

    async def tokens_per_s(self, engine: TorchEngine, prompts: list[list[int]], tokens: int, tag: str) -> float:
        """As `decode_tokens_per_s`, the deltas counted by this counter (the engine's `deliver`)."""
        self._loop, self._done = asyncio.get_running_loop(), asyncio.Event()
        with self._lock:
            self._waiting = {i: [0, 0.0, 0.0] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            engine.submit(GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0.0)), i)
        await self._done.wait()
        counts = list(self._waiting.values())
        assert all(count == [tokens, count[1], count[2], "length"] for count in counts), counts[:3]
        return (tokens - 1) * len(prompts) / (max(c[2] for c in counts) - max(c[1] for c in counts))
