"""Completion rate of constrained answers: how many end `stop`, valid, instead of at `length`.

A random draw of MaskBench schemas (the seed is printed) goes through the served model as chat
requests with `response_format: json_schema`, max_tokens 600, temperature 0.7 and no other
sampling field, once per setting, in the same run:

- `guard_off`: `loop_guard: false` (the server as it was before loop-aware decoding);
- `guard_on`: no extra field (the server's default: loop guard on);
- `dry`: `loop_guard: false` plus the DRY sampler (`dry_multiplier` 0.8, llama.cpp's other defaults);
- `peer` (with --peer-url): the same request body to another OpenAI-compatible server, e.g.
  llama.cpp's `llama-server` on the same GGUF file (docs/benchmarks/completion_rate.md).

Each setting reports the share of served requests ending `stop`, the share of those whose
content validates against the schema (jsonschema), the share ending `length`, requests refused
or failed, and completion tokens per answer. The draw is split into rounds (each its own schemas
and request seeds, every setting on the same ones); figures are given over the whole draw, per
round, and as the spread over rounds.

    python bench/completion_rate.py                       # starts its own server (loopback)
    python bench/completion_rate.py --url http://127.0.0.1:3000 --peer-url http://127.0.0.1:8080 \
        --schemas 100 --rounds 3 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx
import jsonschema

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from measure import machine  # noqa: E402  (bench/ is the script's folder)
from tests.bento_server import bentoml_serve  # noqa: E402

DATA = Path("/work/shared/data/maskbench")
DRY = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}
SETTINGS: dict[str, dict[str, Any]] = {
    "guard_off": {"loop_guard": False},
    "guard_on": {},
    "dry": {"loop_guard": False, **DRY},
}
PROMPT = "Answer with a JSON document matching this JSON schema.\n\nSchema:\n{schema}"


@dataclass
class Outcome:
    finish: str  # stop, length, tool_calls, ... ; "refused" (4xx), "failed" (5xx, transport)
    valid: Optional[bool] = None  # content validates (finish stop only)
    tokens: int = 0
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        served = [o for o in self.outcomes if o.finish not in ("refused", "failed")]
        stopped = [o for o in served if o.finish == "stop"]
        share = lambda part, whole: len(part) / len(whole) if whole else float("nan")  # noqa: E731
        return {
            "requests": len(self.outcomes), "served": len(served),
            "refused": sum(o.finish == "refused" for o in self.outcomes),
            "failed": sum(o.finish == "failed" for o in self.outcomes),
            "stop": share(stopped, served),
            "stop_valid": share([o for o in stopped if o.valid], stopped),
            "stop_and_valid": share([o for o in stopped if o.valid], served),
            "length": share([o for o in served if o.finish == "length"], served),
            "tokens_per_answer": statistics.mean(o.tokens for o in served) if served else float("nan"),
        }


def draw_schemas(count: int, seed: int, max_chars: int) -> list[tuple[str, dict[str, Any]]]:
    """`count` files at random among those whose schema is a JSON object of at most `max_chars`
    (compact), so that the prompt fits the context with room for the answer."""
    files = sorted(DATA.glob("*.json"))
    random.Random(seed).shuffle(files)
    drawn = []
    for path in files:
        schema = json.loads(path.read_text())["schema"]
        if isinstance(schema, dict) and len(json.dumps(schema, separators=(",", ":"))) <= max_chars:
            drawn.append((path.name, schema))
            if len(drawn) == count:
                break
    return drawn


def request_body(schema: dict[str, Any], extra: dict[str, Any], seed: int, max_tokens: int,
                 model: Optional[str]) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": PROMPT.format(schema=json.dumps(schema, separators=(",", ":")))}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        "max_tokens": max_tokens, "temperature": 0.7, "seed": seed, **extra,
    }
    if model:
        body["model"] = model
    return body


def check(schema: dict[str, Any], content: str) -> tuple[bool, str]:
    try:
        jsonschema.validate(json.loads(content), schema)
        return True, ""
    except Exception as e:  # invalid JSON, failed validation, or a schema jsonschema cannot use
        return False, f"{type(e).__name__}: {str(e)[:200]}"


async def ask(client: httpx.AsyncClient, url: str, body: dict[str, Any], schema: dict[str, Any]) -> Outcome:
    try:
        response = await client.post(f"{url}/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        return Outcome("failed", detail=f"{type(e).__name__}: {e}")
    if response.status_code != 200:
        return Outcome("refused" if response.status_code < 500 else "failed",
                       detail=f"{response.status_code}: {response.text[:200]}")
    answer = response.json()
    choice = answer["choices"][0]
    tokens = answer.get("usage", {}).get("completion_tokens", 0)
    finish = choice["finish_reason"]
    content = choice["message"].get("content") or ""
    if finish != "stop":
        return Outcome(finish, tokens=tokens, detail=content[-300:])
    valid, why = check(schema, content)
    return Outcome(finish, valid, tokens, why)


async def run_setting(url: str, schemas: list[tuple[str, dict[str, Any]]], extra: dict[str, Any], seed: int,
                      args: argparse.Namespace, model: Optional[str]) -> tuple[Tally, float]:
    limit = asyncio.Semaphore(args.concurrency)
    tally = Tally()

    async def one(index: int, name: str, schema: dict[str, Any]) -> None:
        async with limit:
            outcome = await ask(client, url, request_body(schema, extra, seed + index, args.max_tokens, model), schema)
        tally.outcomes.append(outcome)
        if args.verbose:
            print(f"  {name}: {outcome.finish} valid={outcome.valid} tokens={outcome.tokens} {outcome.detail!r}",
                  flush=True)

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        await asyncio.gather(*(one(i, name, schema) for i, (name, schema) in enumerate(schemas)))
    return tally, time.monotonic() - start


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}; {machine()}", flush=True)
    schemas = draw_schemas(args.schemas, seed, args.max_schema_chars)
    print(f"{len(schemas)} schemas: {', '.join(name for name, _ in schemas)}", flush=True)
    settings = {name: SETTINGS[name] for name in args.settings}
    targets = [(name, url, extra, None) for name, extra in settings.items()]
    if args.peer_url:
        targets.append(("peer", args.peer_url, {}, args.peer_model))
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in targets}
    totals = {name: Tally() for name, *_ in targets}
    size = -(-len(schemas) // args.rounds)
    for round_index in args.only_rounds if args.only_rounds is not None else range(args.rounds):
        part = schemas[round_index * size:(round_index + 1) * size]
        for name, target_url, extra, model in targets:
            tally, seconds = await run_setting(target_url, part, extra, seed + 1000 * round_index, args, model)
            totals[name].outcomes += tally.outcomes
            summary = {**tally.summary(), "seconds": round(seconds, 1)}
            rounds[name].append(summary)
            print(f"round {round_index} {name}: {json.dumps(summary)}; load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    report = {"seed": seed, "machine": machine(), "schemas": [name for name, _ in schemas],
              "max_tokens": args.max_tokens, "settings": {**settings, **({"peer": args.peer_url} if args.peer_url else {})},
              "rounds": rounds, "totals": {name: tally.summary() for name, tally in totals.items()}}
    for name, results in rounds.items():
        total = totals[name].summary()
        line = ", ".join(f"{key} {total[key]:.3f} (rounds {spread([r[key] for r in results])})"
                         for key in ("stop", "stop_valid", "length", "tokens_per_answer"))
        print(f"{name}: served {total['served']}/{total['requests']}, {line}; refused {total['refused']}, "
              f"failed {total['failed']}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server; default: start `bentoml serve` of this checkout")
    parser.add_argument("--bentoml-home", type=Path, help="model store for the server started here")
    parser.add_argument("--peer-url", help="another OpenAI-compatible server, same requests (e.g. llama-server)")
    parser.add_argument("--peer-model", help="model name to send the peer (default: none)")
    parser.add_argument("--schemas", type=int, default=102, help="drawn in all, split over the rounds")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only-rounds", nargs="+", type=int, metavar="R",
                        help="run these rounds of the draw only (0-based), e.g. to finish a draw in parts")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--max-schema-chars", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--verbose", action="store_true", help="one line per answer")
    args = parser.parse_args()
    if args.url:
        report = asyncio.run(run(args.url, args))
    else:
        home = args.bentoml_home or Path(tempfile.mkdtemp(prefix="completion-rate-"))
        with tempfile.TemporaryDirectory() as logs, \
                bentoml_serve(".", home, Path(logs) / "server.log", suite_numerics=False) as server:
            report = asyncio.run(run(server.url, args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
