"""Prometheus metrics, named like vLLM's (`vllm:` becomes `llgtrt:`), served on the service's /metrics.

BentoML runs prometheus_client in multiprocess mode (PROMETHEUS_MULTIPROC_DIR is in every worker's
environment before it imports the service), so these module-level metrics land in its /metrics with
its own `bentoml_service_*` ones. Gauges are therefore set, never computed on scrape, and say how
workers combine. Outside a server (tests, scripts) they are plain in-process metrics.
A value recorded every engine step or every streamed delta goes through a `DeferredHistogram`, which
keeps the Prometheus write off that path.

Request metrics (tokens, latencies) are taken by `MeteredEngine` around any engine, as the HTTP
layer sees the tokens; engine state (running, waiting, KV cache, queue time), mask fill and
grammar compile times come from hooks where that work happens.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from typing import AsyncIterator, Optional

from prometheus_client import Counter, Gauge, Histogram

from llgtrt_core.engine.interface import Engine, GenerationRequest, TokenDelta
from llgtrt_core.os_threads import name_os_thread

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                          1.0, 2.5, 5.0, 10.0, 20.0)
# Mask fill runs every step and must stay far below a step; compiles range from 0.1 ms to seconds.
_MASK_FILL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

requests_running = Gauge("llgtrt:num_requests_running", "Requests in the engine's batch.",
                         multiprocess_mode="livesum")
requests_waiting = Gauge("llgtrt:num_requests_waiting", "Requests queued in the engine for a batch slot.",
                         multiprocess_mode="livesum")
kv_cache_usage = Gauge("llgtrt:kv_cache_usage_perc", "KV-cache usage: 1 means full.", multiprocess_mode="livemax")
prompt_tokens = Counter("llgtrt:prompt_tokens", "Prompt tokens of the requests the engine took.")
generation_tokens = Counter("llgtrt:generation_tokens", "Tokens the engine generated.")
# A request's tokens reach generation_tokens this many at a time (and the rest at its end): an
# increment per streamed delta cost ~3 us of the event loop in multiprocess mode.
_GENERATION_TOKENS_PER_INC = 16
request_success = Counter("llgtrt:request_success", "Finished engine requests, by finish reason.",
                          ["finished_reason"])
e2e_request_latency = Histogram("llgtrt:e2e_request_latency_seconds", "From submission to the last token.",
                                buckets=_LATENCY_BUCKETS)
preemptions = Counter("llgtrt:num_preemptions", "Running sequences whose KV blocks were taken back for others "
                      "(recomputed later).")
mask_sit_outs = Counter("llgtrt:grammar_mask_sit_outs", "Steps a constrained sequence sat out because its slow "
                        "grammar's token mask was not ready (its draw dropped, made again a step later).")
# vLLM's names; counted in tokens, so hits / queries is the share of prompt tokens not computed.
prefix_cache_queries = Counter("llgtrt:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
prefix_cache_hits = Counter("llgtrt:prefix_cache_hits", "Prompt tokens found in the prefix cache (their KV reused, "
                            "not computed).")
prefix_cache_blocks = Gauge("llgtrt:prefix_cache_blocks", "KV-cache blocks holding a cached prompt prefix, in use "
                            "or evictable.", multiprocess_mode="livesum")
request_queue_time = Histogram("llgtrt:request_queue_time_seconds", "Time waiting for a batch slot.",
                               buckets=_LATENCY_BUCKETS)


class DeferredHistogram:
    """A Histogram for values recorded on a hot path: `observe` only appends to a deque (~0.1 us;
    Histogram.observe takes ~0.7 us, ~2 us in multiprocess mode, where each value goes through a
    lock and an mmap write). A daemon thread, started by the first value, folds the pending values
    into the histogram every `period` seconds with one increment per bucket touched, so /metrics
    shows the same histogram, at most `period` late. Every value counts (sampling would not keep
    `_count` and `_sum` exact), and a scrape-time collector would not work: in multiprocess mode
    /metrics reads the workers' mmap files, not their registries."""

    def __init__(self, histogram: Histogram, period: float = 0.5) -> None:
        self.histogram = histogram
        self.period = period
        self._pending: collections.deque[float] = collections.deque()  # append/popleft: thread-safe
        self._folder: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # one folder thread; one flush at a time

    def observe(self, amount: float) -> None:
        self._pending.append(amount)
        if self._folder is None:
            self._start_folder()

    def flush(self) -> None:
        """Fold every pending value into the histogram now."""
        with self._lock:
            pending = self._pending
            values = [pending.popleft() for _ in range(len(pending))]
            if values:
                observe_many(self.histogram, values)

    def _start_folder(self) -> None:
        with self._lock:
            if self._folder is None:
                self._folder = threading.Thread(target=self._fold_forever, name="metrics-fold", daemon=True)
                self._folder.start()

    def _fold_forever(self) -> None:
        name_os_thread("metrics-fold")  # not the name of the thread that started it (the fill's, often)
        while True:
            time.sleep(self.period)
            self.flush()


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for every v, with one increment per bucket touched. prometheus_client
    has no public bulk call, so this uses the fields `observe` itself uses (`_upper_bounds`,
    `_buckets`, `_sum`); tests check the result equals one `observe` per value."""
    ordered = sorted(values)
    histogram._sum.inc(sum(ordered))
    below = 0
    for bound, bucket in zip(histogram._upper_bounds, histogram._buckets):
        up_to = bisect.bisect_right(ordered, bound)  # observe's bucket: the first bound >= v
        if up_to > below:
            bucket.inc(up_to - below)
            below = up_to


# Observed per streamed delta, on the event loop.
time_to_first_token = DeferredHistogram(Histogram(
    "llgtrt:time_to_first_token_seconds", "From submission to the first token.", buckets=_LATENCY_BUCKETS))
inter_token_latency = DeferredHistogram(Histogram(
    "llgtrt:inter_token_latency_seconds", "Between two tokens of one request.", buckets=_TOKEN_LATENCY_BUCKETS))
mask_fill_time = DeferredHistogram(Histogram(
    "llgtrt:grammar_mask_fill_seconds",
    "One engine step's token-mask computation for all its constrained rows.",
    buckets=_MASK_FILL_BUCKETS))
grammar_compile_time = Histogram("llgtrt:grammar_compile_seconds", "Compiling one grammar (cache misses; the serving "
                                 "process compiles to validate, the engine process to constrain).",
                                 buckets=_COMPILE_BUCKETS)
requests_rejected = Counter("llgtrt:requests_rejected", "HTTP requests refused before reaching the engine.",
                            ["reason"])
engine_restarts = Counter("llgtrt:engine_process_restarts", "Embedded engine processes started again after one "
                          "died (its requests ended with an error).")


def record_engine_state(running: int, waiting: int, kv_usage: float, cached_blocks: int) -> None:
    requests_running.set(running)
    requests_waiting.set(waiting)
    kv_cache_usage.set(kv_usage)
    prefix_cache_blocks.set(cached_blocks)


def record_prefix_lookup(queried_tokens: int, hit_tokens: int) -> None:
    prefix_cache_queries.inc(queried_tokens)
    prefix_cache_hits.inc(hit_tokens)


class MeteredEngine(Engine):
    """The `Engine` interface over another engine, recording each request's tokens and latencies."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:  # type: ignore[override]
        return self.engine.max_model_len  # known once the engine started

    async def start(self) -> None:
        await self.engine.start()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    @property
    def num_active(self) -> int:
        return self.engine.num_active

    @property
    def failure(self) -> Optional[str]:
        return self.engine.failure

    async def stats(self) -> dict[str, object]:
        return await self.engine.stats()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        deltas = self.engine.generate(request)
        start = last = time.perf_counter()
        started = first_token = False
        uncounted = 0  # tokens not yet in generation_tokens
        finish_reason = "abort"  # unless the engine says otherwise: the consumer went away
        try:
            async for delta in deltas:
                if not started:  # the engine took the request (it may refuse it on the first step)
                    started = True
                    prompt_tokens.inc(len(request.prompt_token_ids))
                if delta.token_ids:
                    now = time.perf_counter()
                    (inter_token_latency if first_token else time_to_first_token).observe(now - last)
                    first_token, last = True, now
                    uncounted += len(delta.token_ids)
                    if uncounted >= _GENERATION_TOKENS_PER_INC:
                        generation_tokens.inc(uncounted)
                        uncounted = 0
                if delta.finish_reason is not None:
                    finish_reason = delta.finish_reason
                yield delta
        finally:
            if uncounted:
                generation_tokens.inc(uncounted)
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()
            if started:
                e2e_request_latency.observe(time.perf_counter() - start)
                request_success.labels(finished_reason=finish_reason).inc()
