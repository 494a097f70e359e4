"""HTTP load test: N concurrent streaming chat clients against `bentoml serve`.

Each client streams /v1/chat/completions (SSE) in a closed loop, one request after another,
for --seconds or until --requests have been sent. The clients are spread over processes
(--client-processes; default one per 32 streams, at most half the cores), so that parsing the
SSE chunks of 256 streams does not queue up in one Python process and show as server latency.
Reported, from the client's side:
TTFT (request sent -> first content chunk) and TBT (time between content chunks) p50/p99,
streamed tokens/s across all streams (usage.completion_tokens of finished requests / wall
time), and errors (non-200 answers, error events, broken streams).

To isolate what the HTTP layer adds, the server's own view of the same requests is read from
/metrics before and after the run: `llgtrt:time_to_first_token_seconds` and
`llgtrt:inter_token_latency_seconds`, taken where the HTTP layer pulls each delta from the
engine (llgtrt_core/metrics.py). Client minus engine is the time spent after the engine:
serialization, SSE framing, the socket, the client. Means are exact (sum / count); p50 of a
histogram is interpolated within its bucket, so it is only as fine as the buckets. In a steady
stream a constant per-token delay shifts every chunk alike and cancels out of the TBT mean: it
shows in TTFT and in the TBT spread, while a layer too slow to keep up raises both TBTs.

    python bench/http_load.py                                   # starts its own server (loopback)
    python bench/http_load.py --url http://127.0.0.1:3000 --clients 256 --seconds 60
    python bench/http_load.py --bentoml-home /tmp/llama-home --model llama3-8b-random \
        --max-batch-size 256 --max-model-len 2048 --clients 256      # a GPU, bench/random_checkpoint.py's model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Optional
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from llgtrt_core.heap import freeze_loaded_objects  # noqa: E402
from measure import machine, percentile  # noqa: E402  (bench/ is the script's folder)
from tests.bento_server import bentoml_serve  # noqa: E402

QUESTIONS = (
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Write a poem about autumn leaves.",
    "Describe the water cycle in detail.",
    "What should I pack for a week of hiking?",
    "Summarize the history of the printing press.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
)
ENGINE_TTFT = "llgtrt:time_to_first_token_seconds"
ENGINE_ITL = "llgtrt:inter_token_latency_seconds"
METRICS_FOLD_WAIT_S = 0.6  # llgtrt_core.metrics.DeferredHistogram folds values in every 0.5 s
STREAMS_PER_PROCESS = 32


@dataclass
class StreamResult:
    """One streamed request as the client saw it; times in seconds."""

    error: Optional[str] = None
    ttft: Optional[float] = None
    gaps: list[float] = field(default_factory=list)  # between consecutive content chunks
    chunks: int = 0  # chunks with content
    tokens: int = 0  # usage.completion_tokens (0 when the stream broke before it)
    finish_reason: Optional[str] = None
    chunk_times: list[float] = field(default_factory=list)  # time.perf_counter of each content chunk
    text: str = ""  # the streamed content
    cached_tokens: Optional[int] = None  # usage.prompt_tokens_details.cached_tokens, when the server says


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    """POST a streaming chat completion and time its SSE content chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {str(event['error'])[:200]}"
                    return result
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                    result.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in event.get("choices", ()):
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    if choice.get("delta", {}).get("content"):
                        result.text += choice["delta"]["content"]
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.gaps.append(now - last)
                        last = now
                        result.chunks += 1
                        result.chunk_times.append(now)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def summarize(results: list[StreamResult], seconds: float) -> dict[str, Any]:
    """Client-side latency and throughput of a set of finished requests."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "tokens": tokens, "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
        "tokens_per_chunk": tokens / chunks if chunks else float("nan"),
        "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
        "ttft_mean": statistics.fmean(ttfts) if ttfts else float("nan"),
        "tbt_p50": percentile(gaps, 50), "tbt_p99": percentile(gaps, 99),
        "tbt_mean": statistics.fmean(gaps) if gaps else float("nan"),
        "tbt_samples": len(gaps),
    }


# --- the server's /metrics -------------------------------------------------------------------

@dataclass
class Histogram:
    buckets: dict[float, float]  # upper bound -> cumulative count
    sum: float
    count: float

    def minus(self, before: "Histogram") -> "Histogram":
        return Histogram({le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.sum - before.sum, self.count - before.count)

    def mean(self) -> float:
        return self.sum / self.count if self.count else float("nan")

    def quantile(self, q: float) -> float:
        """Linear interpolation inside the bucket holding the q-th observation (as Prometheus does)."""
        if not self.count:
            return float("nan")
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cumulative in sorted(self.buckets.items()):
            if cumulative >= rank:
                if le == float("inf"):
                    return lower
                return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
            lower, below = le, cumulative
        return lower


def read_histogram(metrics_text: str, name: str) -> Histogram:
    """Sum of a histogram's series over all label sets (BentoML's workers are merged already)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value
    return Histogram(buckets, total, count)


async def scrape_metrics(client: httpx.AsyncClient, url: str) -> str:
    """/metrics once the server's deferred histograms (folded every 0.5 s) hold what was observed."""
    await asyncio.sleep(METRICS_FOLD_WAIT_S)
    return (await client.get(f"{url}/metrics")).text


async def engine_histograms(client: httpx.AsyncClient, url: str) -> dict[str, Histogram]:
    text = await scrape_metrics(client, url)
    return {name: read_histogram(text, name) for name in (ENGINE_TTFT, ENGINE_ITL)}


async def engine_stats(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """The engine's counters (/v1/engine/stats): steps run and each phase's totals of its step loop."""
    return (await client.get(f"{url}/v1/engine/stats")).json()


def per_step(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Each phase's wall and CPU ms per engine step between two `engine_stats`; the steps, mixed
    steps and sit-outs (draws dropped: a slow grammar's mask was late) between them."""
    def counted(key: str) -> int:  # a counter's growth between the two (absent: the engine keeps none)
        return (after.get(key) or 0) - (before.get(key) or 0)

    steps = counted("num_steps")
    phases = {}
    for name, total in after.get("step_phases", {}).items():
        earlier = before.get("step_phases", {}).get(name, {"count": 0, "wall_s": 0.0, "cpu_s": 0.0})
        phases[name] = {key: (total[key] - earlier[key]) * 1e3 / max(steps, 1) for key in ("wall_s", "cpu_s")}
        phases[name]["per_step"] = (total["count"] - earlier["count"]) / max(steps, 1)
    return {"steps": steps, "mixed_steps": counted("num_mixed_steps"), "sit_outs": counted("num_sit_outs"),
            "phases": phases}


def engine_vs_client(before: dict[str, Histogram], after: dict[str, Histogram],
                     client: dict[str, Any]) -> dict[str, Any]:
    """The engine's TTFT and inter-token latency over the run, and what the client saw on top."""
    ttft, itl = after[ENGINE_TTFT].minus(before[ENGINE_TTFT]), after[ENGINE_ITL].minus(before[ENGINE_ITL])
    out = {"engine_ttft_mean": ttft.mean(), "engine_ttft_p50_bucket": ttft.quantile(0.5),
           "engine_itl_mean": itl.mean(), "engine_itl_p50_bucket": itl.quantile(0.5),
           "engine_itl_p99_bucket": itl.quantile(0.99), "engine_itl_samples": itl.count}
    out["http_tbt_mean_added"] = client["tbt_mean"] - out["engine_itl_mean"]
    out["http_tbt_mean_ratio"] = client["tbt_mean"] / out["engine_itl_mean"] if itl.count else float("nan")
    out["http_tbt_p50_added"] = client["tbt_p50"] - out["engine_itl_p50_bucket"]
    out["http_tbt_p50_ratio"] = client["tbt_p50"] / out["engine_itl_p50_bucket"] if itl.count else float("nan")
    out["http_ttft_mean_added"] = client["ttft_mean"] - out["engine_ttft_mean"]
    return out


# --- the server ------------------------------------------------------------------------------

@contextlib.contextmanager
def server_url(args: argparse.Namespace) -> Iterator[str]:
    """--url as given, or `bentoml serve .` on a free loopback port serving --model from --bentoml-home
    (without --model, the default model, which the service packs there on its first start)."""
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit(f"loopback only: {args.url}")
        yield args.url.rstrip("/")
        return
    log = args.server_log or Path(tempfile.mkdtemp(prefix="http-load-")) / "bentoml-serve.log"
    print(f"starting bentoml serve (log {log}) ...", flush=True)
    started = time.monotonic()
    with bentoml_serve(".", args.bentoml_home, log, env=server_env(args), suite_numerics=False) as server:
        print(f"server ready after {time.monotonic() - started:.0f} s", flush=True)
        yield server.url


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server on loopback (default: start one)")
    parser.add_argument("--bentoml-home", type=Path, default=Path(tempfile.gettempdir()) / "llgtrt-bench-home",
                        help="model store of the server started here")
    parser.add_argument("--model", default=None, help="LLGTRT_MODEL: a tag in --bentoml-home, e.g. one "
                        "bench/random_checkpoint.py stored (default: the default model, packed first)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="LLGTRT_MAX_BATCH_SIZE of the server started here (server default: 8)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="LLGTRT_MAX_MODEL_LEN of the server started here (default: the model's context)")
    parser.add_argument("--device", default=None, help="LLGTRT_DEVICE of the server started here")
    parser.add_argument("--server-log", type=Path, default=None, help="its log (default: a temporary file)")


def server_env(args: argparse.Namespace) -> dict[str, str]:
    variables = {"LLGTRT_MODEL": args.model, "LLGTRT_MAX_BATCH_SIZE": args.max_batch_size,
                 "LLGTRT_MAX_MODEL_LEN": args.max_model_len, "LLGTRT_DEVICE": args.device}
    return {name: str(value) for name, value in variables.items() if value}


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]


def new_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


# --- client processes ------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamJob:
    """The streams one client process runs, all starting at `start_at` (time.monotonic, shared by
    the processes of one machine): each body once, or each in a closed loop until `deadline`."""

    url: str
    bodies: list[dict[str, Any]]
    start_at: float
    deadline: Optional[float]
    requests: Optional[int]  # this process's share of a request cap
    timeout_s: float


async def run_streams(job: StreamJob) -> list[StreamResult]:
    results: list[tuple[int, StreamResult]] = []  # (body index, result)
    sent = 0
    async with new_client(len(job.bodies), job.timeout_s) as client:
        await asyncio.sleep(max(0.0, job.start_at - time.monotonic()))

        async def stream_loop(index: int, body: dict[str, Any]) -> None:
            nonlocal sent
            while job.requests is None or sent < job.requests:
                sent += 1
                results.append((index, await stream_chat(client, job.url, body)))
                if job.deadline is None or time.monotonic() >= job.deadline:
                    return

        await asyncio.gather(*(stream_loop(index, body) for index, body in enumerate(job.bodies)))
    return [result for _, result in sorted(results, key=lambda item: item[0])]


def run_stream_job(job: StreamJob) -> list[StreamResult]:
    # Before the start, as the server does: a full collection of this process's ~0.3 M objects
    # paused every stream it reads for up to 110 ms (engine.md, session 11).
    freeze_loaded_objects()
    return asyncio.run(run_streams(job))


def _spawned() -> None:
    time.sleep(0.2)  # long enough that each of the pool's first jobs lands on a worker of its own


class ClientProcesses:
    """Streaming clients spread over processes: one Python process parses SSE chunks at a bounded rate
    (httpx + json, tens of microseconds each), and a client that falls behind adds its own delay to
    every TBT it reports. Workers are spawned (and import httpx) once, before any timing."""

    def __init__(self, processes: int, timeout_s: float) -> None:
        self.processes = processes
        self.timeout_s = timeout_s
        self.pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
        for future in [self.pool.submit(_spawned) for _ in range(processes)]:
            future.result()

    def close(self) -> None:
        self.pool.shutdown()

    async def run(self, url: str, bodies: list[dict[str, Any]], seconds: Optional[float] = None,
                  requests: Optional[int] = None) -> tuple[list[StreamResult], float]:
        """Every body as one stream, dealt round-robin to the processes: sent once each, or in closed
        loops for `seconds` (no new request after), stopping sooner once about `requests` are sent.
        Returns the results (sent once each: in the bodies' order) and the seconds from the common
        start to the last stream's end."""
        parts = [bodies[i::self.processes] for i in range(min(self.processes, len(bodies)))]
        start_at = time.monotonic() + 0.1 * len(parts)  # each submit and its pickling land before the start
        deadline = start_at + seconds if seconds is not None else None
        jobs = [StreamJob(url, part, start_at, deadline,
                          None if requests is None else -(-requests * len(part) // len(bodies)), self.timeout_s)
                for part in parts]
        loop = asyncio.get_running_loop()
        done = await asyncio.gather(*(loop.run_in_executor(self.pool, run_stream_job, job) for job in jobs))
        elapsed = time.monotonic() - start_at
        if seconds is None and requests is None:
            ordered: list[StreamResult] = [StreamResult()] * len(bodies)
            for index, part in enumerate(done):
                ordered[index::len(parts)] = part
            return ordered, elapsed
        return [r for part in done for r in part], elapsed


def default_processes(streams: int) -> int:
    """A process per STREAMS_PER_PROCESS concurrent streams, leaving half the cores to the server."""
    return max(1, min(-(-streams // STREAMS_PER_PROCESS), (os.cpu_count() or 2) // 2))


# --- the load test ---------------------------------------------------------------------------

def chat_bodies(model: str, clients: int, max_tokens: int) -> list[dict[str, Any]]:
    return [{"model": model, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
             "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True} for i in range(clients)]


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def print_report(client: dict[str, Any], server: dict[str, Any]) -> None:
    print(f"requests {client['requests']}, errors {client['errors']} {client['error_samples'] or ''}")
    print(f"streamed {client['tokens']} tokens, {client['tokens_per_s']:.1f} tokens/s across all streams "
          f"({client['tokens_per_chunk']:.2f} tokens per content chunk)")
    print(f"client  TTFT p50 {ms(client['ttft_p50'])} ms  p99 {ms(client['ttft_p99'])} ms  "
          f"mean {ms(client['ttft_mean'])} ms")
    print(f"client  TBT  p50 {ms(client['tbt_p50'])} ms  p99 {ms(client['tbt_p99'])} ms  "
          f"mean {ms(client['tbt_mean'])} ms  ({client['tbt_samples']} gaps)")
    print(f"engine  TTFT mean {ms(server['engine_ttft_mean'])} ms  p50 ~{ms(server['engine_ttft_p50_bucket'])} ms "
          f"(bucket estimate)")
    print(f"engine  ITL  mean {ms(server['engine_itl_mean'])} ms  p50 ~{ms(server['engine_itl_p50_bucket'])} ms  "
          f"p99 ~{ms(server['engine_itl_p99_bucket'])} ms "
          f"(bucket estimates, {server['engine_itl_samples']:.0f} samples)")
    print(f"HTTP layer: TBT mean +{ms(server['http_tbt_mean_added'])} ms per chunk "
          f"(client/engine {server['http_tbt_mean_ratio']:.3f}), TBT p50 {server['http_tbt_p50_added'] * 1e3:+.1f} ms "
          f"(ratio {server['http_tbt_p50_ratio']:.3f}, against a bucket estimate), "
          f"TTFT mean +{ms(server['http_ttft_mean_added'])} ms")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with server_url(args) as url:
        async with new_client(4, args.request_timeout) as client:
            model = await served_model(client, url)
            pool = ClientProcesses(args.client_processes or default_processes(args.clients), args.request_timeout)
            try:
                await pool.run(url, chat_bodies(model, min(args.clients, 2), 4))  # warm-up: first-request work
                print(f"{machine()}; {args.clients} clients in {pool.processes} processes, max_tokens "
                      f"{args.max_tokens}, {'%d requests' % args.requests if args.requests else '%g s' % args.seconds}",
                      flush=True)
                before = await engine_histograms(client, url)
                results, seconds = await pool.run(url, chat_bodies(model, args.clients, args.max_tokens),
                                                  args.seconds, args.requests)
                after = await engine_histograms(client, url)
            finally:
                pool.close()
    client_side = summarize(results, seconds)
    server_side = engine_vs_client(before, after, client_side)
    print(f"ran {seconds:.1f} s; load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print_report(client_side, server_side)
    return {"client_processes": pool.processes, "seconds": seconds, "client": client_side, "server": server_side}


def run_main(parser: argparse.ArgumentParser, main_async: Callable[[argparse.Namespace], Awaitable[dict]]) -> None:
    """The common tail of the HTTP benchmarks: client options, run, report as JSON."""
    parser.add_argument("--client-processes", type=int, default=None,
                        help=f"processes the streams are spread over (default: one per {STREAMS_PER_PROCESS} "
                             "streams, at most half the cores)")
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    report = {"args": {k: str(v) for k, v in vars(args).items()}, **asyncio.run(main_async(args)),
              "machine": machine()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams (the GPU goal is 256)")
    parser.add_argument("--seconds", type=float, default=60, help="no new request after this")
    parser.add_argument("--requests", type=int, default=None, help="stop sooner after about this many requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (ignore_eos: all of them)")
    run_main(parser, main_async)


if __name__ == "__main__":
    main()
