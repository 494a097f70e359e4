"""Prefix caching on an agent-like workload: the same server with the cache on and off, in one run.

Agent workload: --conversations concurrent conversations of --turns turns each. Every request
starts with one shared system prompt of about --system-tokens tokens (instructions and tool
definitions as JSON schemas), then the conversation so far (each earlier user turn and the
model's streamed answer to it) and a short new user turn. Control workload: the same number of
single-turn requests, each with a system prompt of its own (--control-tokens), so no two share
more than the chat template's header: what caching costs when it cannot help.

Two servers are measured side by side: one with `runtime.enable_kv_cache_reuse` on, one with it
off (started here, or --url / --url-off for running ones). Each round draws new prompts (seed,
round) and sends the same ones to both, the servers' order alternating by round, so that the
system prompt is cold at each round's start on the cached server too. Per round and server:
TTFT p50 / p90 (client side, request sent -> first content chunk), completion tokens / s and
requests / s over the round's wall time, cached prompt tokens from `usage` and the hit rate from
/metrics (`llgtrt:prefix_cache_hits_total` / `..._queries_total`). Prompts are plain English
text, so any chat model serves them (the default model on a CPU, the random-weight Llama-3-8B
on a GPU).

    nice -n 5 python bench/prefix_cache.py --rounds 3 --json /tmp/prefix_cache.json
    python bench/prefix_cache.py --bentoml-home /tmp/llama-home --model llama3-8b-random \\
        --max-model-len 4096 --kv-cache-max-tokens 131072 --conversations 32 --turns 4    # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import httpx

import http_load  # noqa: E402  (bench/ is the script's folder; it puts the repo on sys.path)
from http_load import StreamResult, new_client, scrape_metrics, served_model, stream_chat
from measure import machine, percentile
from tests.bento_server import bentoml_serve

WORDS = ("account", "address", "amount", "archive", "balance", "batch", "branch", "budget", "cache", "calendar",
         "channel", "city", "client", "comment", "contract", "country", "currency", "customer", "dataset", "date",
         "deadline", "device", "discount", "document", "domain", "draft", "email", "employee", "event", "file",
         "flight", "folder", "forecast", "group", "hotel", "image", "invoice", "issue", "label", "language",
         "limit", "location", "meeting", "message", "metric", "note", "order", "owner", "package", "payment",
         "period", "phone", "playlist", "policy", "price", "priority", "product", "project", "query", "quota",
         "receipt", "record", "region", "reminder", "report", "request", "reservation", "review", "room",
         "schedule", "score", "search", "section", "sensor", "server", "session", "shipment", "size", "status",
         "stock", "store", "subject", "summary", "supplier", "task", "team", "template", "ticket", "timezone",
         "title", "topic", "track", "transaction", "unit", "user", "vendor", "version", "warehouse", "weather")
VERBS = ("get", "list", "create", "update", "delete", "search", "cancel", "schedule", "send", "export", "check")
TYPES = ("string", "integer", "number", "boolean")
ASKS = ("Can you", "Please", "I need you to", "Could you", "Quickly", "Next,")
HITS, QUERIES = "llgtrt:prefix_cache_hits_total", "llgtrt:prefix_cache_queries_total"


# --- prompts ---------------------------------------------------------------------------------

def tool_definition(rng: random.Random) -> dict[str, Any]:
    noun = rng.choice(WORDS)
    params = {rng.choice(WORDS): {"type": rng.choice(TYPES), "description": f"the {rng.choice(WORDS)} "
                                  f"of the {noun}, as the {rng.choice(WORDS)} gives it"}
              for _ in range(rng.randrange(2, 6))}
    return {"name": f"{rng.choice(VERBS)}_{noun}", "description": f"{rng.choice(VERBS).capitalize()} a {noun} "
            f"for the {rng.choice(WORDS)} and return its {rng.choice(WORDS)} and {rng.choice(WORDS)}.",
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]}}


def system_prompt(rng: random.Random, tokens: int) -> str:
    """Instructions, then tool definitions until about `tokens` tokens (4 characters a token). A random
    header makes each prompt differ from its first token on."""
    parts = [f"Session {rng.getrandbits(64):016x}. You are an assistant for the {rng.choice(WORDS)} team. "
             "Answer briefly. When a tool helps, call it with JSON arguments that match its schema. Tools:"]
    while sum(len(p) for p in parts) < 4 * tokens:
        parts.append(json.dumps(tool_definition(rng)))
    return "\n".join(parts)


def user_turn(rng: random.Random) -> str:
    return (f"{rng.choice(ASKS)} {rng.choice(VERBS)} the {rng.choice(WORDS)} of {rng.choice(WORDS)} "
            f"{rng.randrange(1000)} for the {rng.choice(WORDS)}?")


# --- workloads -------------------------------------------------------------------------------

async def conversation(client: httpx.AsyncClient, url: str, model: str, system: str, turns: list[str],
                       max_tokens: int) -> list[StreamResult]:
    """The turns one after another, each answer part of the next request."""
    messages = [{"role": "system", "content": system}]
    results = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        result = await stream_chat(client, url, {"model": model, "messages": messages, "max_tokens": max_tokens,
                                                 "temperature": 0.0, "ignore_eos": True})
        results.append(result)
        if result.error is not None:
            break
        messages.append({"role": "assistant", "content": result.text})
    return results


def agent_workload(seed: int, args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    rng = random.Random(f"agent {seed}")  # not the control's draws: its first prompt would start the same
    system = system_prompt(rng, args.system_tokens)
    return [(system, [user_turn(rng) for _ in range(args.turns)]) for _ in range(args.conversations)]


def control_workload(seed: int, args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    rng = random.Random(f"control {seed}")
    return [(system_prompt(rng, args.control_tokens), [user_turn(rng)])
            for _ in range(args.conversations * args.turns)]


async def run_workload(url: str, workload: list[tuple[str, list[str]]], args: argparse.Namespace
                       ) -> dict[str, Any]:
    """Every conversation at once (at most --conversations at a time); figures of the round."""
    async with new_client(args.conversations, args.request_timeout) as client:
        model = await served_model(client, url)
        before = await prefix_counters(client, url)
        limit = asyncio.Semaphore(args.conversations)

        async def limited(system: str, turns: list[str]) -> list[StreamResult]:
            async with limit:
                return await conversation(client, url, model, system, turns, args.max_tokens)

        started = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(limited(s, t) for s, t in workload)) for r in rs]
        wall = time.perf_counter() - started
        after = await prefix_counters(client, url)
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    queries = after[QUERIES] - before[QUERIES]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "wall_s": wall, "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
        "tokens_per_s": sum(r.tokens for r in ok) / wall, "requests_per_s": len(ok) / wall,
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "hit_rate": (after[HITS] - before[HITS]) / queries if queries else 0.0,
    }


async def prefix_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = await scrape_metrics(client, url)
    values = {HITS: 0.0, QUERIES: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


# --- servers and report ----------------------------------------------------------------------

@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """{"on": url, "off": url}: --url / --url-off, or two servers started here side by side."""
    if args.url or args.url_off:
        if not (args.url and args.url_off):
            raise SystemExit("--url (cache on) and --url-off (cache off) go together")
        for url in (args.url, args.url_off):
            if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
                raise SystemExit(f"loopback only: {url}")
        yield {"on": args.url.rstrip("/"), "off": args.url_off.rstrip("/")}
        return
    folder = Path(tempfile.mkdtemp(prefix="prefix-cache-"))
    with contextlib.ExitStack() as stack:
        urls = {}
        for label, reuse in (("on", True), ("off", False)):
            runtime: dict[str, Any] = {"enable_kv_cache_reuse": reuse}
            if args.kv_cache_max_tokens:
                runtime["kv_cache_max_tokens"] = args.kv_cache_max_tokens
            config = folder / f"{label}.json5"
            config.write_text(json.dumps({"runtime": runtime}))
            env = {**http_load.server_env(args), "LLGTRT_CONFIG": str(config)}
            # A BentoML home of its own (the model store shared): BentoML keeps /metrics's multiprocess
            # files under the home, and a server starting clears them.
            home = folder / f"{label}-home"
            home.mkdir()
            args.bentoml_home.joinpath("models").mkdir(parents=True, exist_ok=True)
            (home / "models").symlink_to(args.bentoml_home.resolve() / "models")
            print(f"starting the cache-{label} server (log {folder / label}.log) ...", flush=True)
            urls[label] = stack.enter_context(bentoml_serve(".", home, folder / f"{label}.log", env=env)).url
        yield urls


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each server's figures over the rounds, and on against off round by round."""
    summary: dict[str, Any] = {}
    for workload in ("agent", "control"):
        runs = [r[workload] for r in rounds]
        summary[workload] = {
            label: {key: spread([run[label][key] for run in runs])
                    for key in ("ttft_p50", "ttft_p90", "tokens_per_s", "requests_per_s", "hit_rate")}
            for label in ("on", "off")}
        summary[workload]["ttft_p50_off_over_on"] = spread([run["off"]["ttft_p50"] / run["on"]["ttft_p50"]
                                                            for run in runs])
        summary[workload]["tokens_per_s_on_over_off"] = spread([run["on"]["tokens_per_s"] / run["off"]["tokens_per_s"]
                                                                for run in runs])
    return summary


def print_round(index: int, workload: str, figures: dict[str, dict[str, Any]]) -> None:
    for label, f in figures.items():
        print(f"round {index} {workload:7s} cache {label:3s}: TTFT p50 {f['ttft_p50'] * 1e3:7.0f} ms, p90 "
              f"{f['ttft_p90'] * 1e3:7.0f} ms, {f['tokens_per_s']:6.1f} tok/s, {f['requests_per_s']:5.2f} req/s, "
              f"cached {f['cached_tokens']} tokens, hit rate {f['hit_rate']:.2f}, errors {f['errors']}", flush=True)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    print(f"seed {args.seed}; {machine()}", flush=True)
    rounds = []
    with servers(args) as urls:
        for url in urls.values():  # warm-up: first-request costs out of the rounds
            await run_workload(url, control_workload(-1, argparse.Namespace(**{**vars(args), "turns": 1})), args)
        for index in range(args.rounds):
            order = ("on", "off") if index % 2 == 0 else ("off", "on")
            seed = args.seed * 1000 + index
            figures: dict[str, Any] = {}
            for workload, build in (("agent", agent_workload), ("control", control_workload)):
                prompts = build(seed, args)
                figures[workload] = {label: await run_workload(urls[label], prompts, args) for label in order}
                print_round(index, workload, figures[workload])
            rounds.append(figures)
    summary = summarize(rounds)
    for workload in ("agent", "control"):
        s = summary[workload]
        print(f"{workload}: TTFT p50 off/on {s['ttft_p50_off_over_on']}, tok/s on/off {s['tokens_per_s_on_over_off']}")
    return {"seed": args.seed, "rounds": rounds, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    http_load.add_server_arguments(parser)
    parser.add_argument("--url-off", default=None, help="a running server with the cache off (with --url: on)")
    parser.add_argument("--kv-cache-max-tokens", type=int, default=None,
                        help="runtime.kv_cache_max_tokens of both servers started here (on a GPU: room for two)")
    parser.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=4, help="at once")
    parser.add_argument("--turns", type=int, default=3, help="per conversation")
    parser.add_argument("--system-tokens", type=int, default=1500, help="the shared system prompt, about")
    parser.add_argument("--control-tokens", type=int, default=512, help="each control prompt, about")
    parser.add_argument("--max-tokens", type=int, default=16, help="per answer (ignore_eos: all of them)")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.randrange(1 << 20)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, **asyncio.run(main_async(args)),
              "machine": machine()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
