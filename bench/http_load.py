"""HTTP load test: N concurrent streaming chat clients against `bentoml serve`.

Each client streams /v1/chat/completions (SSE) in a closed loop, one request after another,
for --seconds or until --requests have been sent. Reported, from the client's side:
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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlparse

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.bento_server import bentoml_serve  # noqa: E402

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PACK_TIMEOUT_S = 600
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


@dataclass
class StreamResult:
    """One streamed request as the client saw it; times in seconds."""

    error: Optional[str] = None
    ttft: Optional[float] = None
    gaps: list[float] = field(default_factory=list)  # between consecutive content chunks
    chunks: int = 0  # chunks with content
    tokens: int = 0  # usage.completion_tokens (0 when the stream broke before it)
    finish_reason: Optional[str] = None


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
                for choice in event.get("choices", ()):
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    if choice.get("delta", {}).get("content"):
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.gaps.append(now - last)
                        last = now
                        result.chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


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

_SAMPLE = re.compile(r'^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')


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
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if not match or not match["name"].startswith(name):
            continue
        value = float(match["value"])
        suffix = match["name"][len(name):]
        if suffix == "_bucket":
            le = float(re.search(r'le="([^"]+)"', match["labels"] or "")[1])
            buckets[le] = buckets.get(le, 0.0) + value
        elif suffix == "_sum":
            total += value
        elif suffix == "_count":
            count += value
    return Histogram(buckets, total, count)


async def engine_histograms(client: httpx.AsyncClient, url: str) -> dict[str, Histogram]:
    text = (await client.get(f"{url}/metrics")).text
    return {name: read_histogram(text, name) for name in (ENGINE_TTFT, ENGINE_ITL)}


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

def default_model_packed(bentoml_home: Path) -> bool:
    return (bentoml_home / "models" / DEFAULT_MODEL_NAME / "latest").exists()


@contextlib.contextmanager
def server_url(url: Optional[str], bentoml_home: Path, env: dict[str, str]) -> Iterator[str]:
    """`url` as given, or `bentoml serve .` on a free loopback port (the default model packed first)."""
    if url:
        if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit(f"loopback only: {url}")
        yield url.rstrip("/")
        return
    if not default_model_packed(bentoml_home):
        print(f"packing the default model into {bentoml_home} ...", flush=True)
        subprocess.run([sys.executable, "pack_model.py"], cwd=REPO_ROOT, check=True, timeout=PACK_TIMEOUT_S,
                       env={**os.environ, "BENTOML_HOME": str(bentoml_home), "BENTOML_DO_NOT_TRACK": "true"})
    log = Path(tempfile.mkdtemp(prefix="http-load-")) / "bentoml-serve.log"
    print(f"starting bentoml serve (log {log}) ...", flush=True)
    with bentoml_serve(".", bentoml_home, log, env=env) as server:
        yield server.url


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server on loopback (default: start one)")
    parser.add_argument("--bentoml-home", type=Path, default=Path(tempfile.gettempdir()) / "llgtrt-bench-home",
                        help="model store of the server started here (the default model is packed into it)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="LLGTRT_MAX_BATCH_SIZE of the server started here (server default: 8)")
    parser.add_argument("--device", default=None, help="LLGTRT_DEVICE of the server started here")


def server_env(args: argparse.Namespace) -> dict[str, str]:
    env = {}
    if args.max_batch_size:
        env["LLGTRT_MAX_BATCH_SIZE"] = str(args.max_batch_size)
    if args.device:
        env["LLGTRT_DEVICE"] = args.device
    return env


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]


def new_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


def machine() -> str:
    return f"{platform.node()}, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


# --- the load test ---------------------------------------------------------------------------

async def load(client: httpx.AsyncClient, url: str, model: str, clients: int, seconds: float,
               requests: Optional[int], max_tokens: int) -> tuple[list[StreamResult], float]:
    """`clients` closed loops until the deadline (no new request after it) or `requests` sent."""
    results: list[StreamResult] = []
    sent = 0
    start = time.perf_counter()
    deadline = start + seconds

    async def client_loop(index: int) -> None:
        nonlocal sent
        while time.perf_counter() < deadline and (requests is None or sent < requests):
            question = QUESTIONS[(index + sent) % len(QUESTIONS)]
            sent += 1
            body = {"model": model, "messages": [{"role": "user", "content": question}],
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            results.append(await stream_chat(client, url, body))

    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return results, time.perf_counter() - start


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
    with server_url(args.url, args.bentoml_home, server_env(args)) as url:
        async with new_client(args.clients, args.request_timeout) as client:
            model = await served_model(client, url)
            await load(client, url, model, min(args.clients, 2), 60, 2, 4)  # warm-up: first-request work
            print(f"{machine()}; {args.clients} clients, max_tokens {args.max_tokens}, "
                  f"{'%d requests' % args.requests if args.requests else '%g s' % args.seconds}", flush=True)
            before = await engine_histograms(client, url)
            results, seconds = await load(client, url, model, args.clients, args.seconds, args.requests,
                                          args.max_tokens)
            after = await engine_histograms(client, url)
    client_side = summarize(results, seconds)
    server_side = engine_vs_client(before, after, client_side)
    print(f"ran {seconds:.1f} s; load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print_report(client_side, server_side)
    return {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "seconds": seconds,
            "client": client_side, "server": server_side}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams (the GPU goal is 256)")
    parser.add_argument("--seconds", type=float, default=60, help="no new request after this")
    parser.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="per request (ignore_eos: all of them)")
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
