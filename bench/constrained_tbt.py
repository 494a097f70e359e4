"""Constrained against unconstrained decoding through the HTTP server: TBT and TTFT by batch size.

Requests are built from MaskBench schemas (../shared/data/maskbench): the prompt asks for a JSON
object and quotes the schema's first 1,000 characters, and the constrained request adds the whole
schema as `response_format: {"type": "json_schema", ...}`; otherwise the two are the same request
(same prompt, max_tokens, greedy). Schemas are drawn from the whole pool (any size, unless
--max-schema-chars says otherwise) in an order shuffled by --seed (random by default, and printed),
and kept when the server compiles them (a 400 means it refused one); these first requests
(max_tokens 1) pay for the compile, which is reported apart as the first-sight TTFT (each after the
same prompt unconstrained, which warms the server up for its shapes), and they leave the grammars
in the server's cache, as a schema that many requests share would be. Each round takes the next
schemas of the draw.

For each --batch B, each round sends B constrained requests at once, then their B unconstrained
twins at once, each writing exactly as many tokens as its constrained answer did (`plain_twin`:
the same work but for the masks, where unpaired plain rows all ran to max_tokens). TBT is
the time between content chunks, TTFT from sending to the first content chunk, both streamed
(SSE) by client processes as in bench/http_load.py. Reported: median TBT constrained /
unconstrained; the same for the time per output token of each request (first to last chunk over
its tokens after the first), which unlike TBT does not change when the grammar's forced tokens
arrive several to a chunk; the TTFT overhead p50 (p50 constrained - p50 unconstrained); and the
engine's mask-fill time per step from the server's /metrics (`llgtrt:grammar_mask_fill_seconds`).
--control makes the first wave of each round unconstrained too: an A/A run, whose ratios are the
measurement's own noise (the waves' prompts are admitted over the first steps, and where each
request's tokens fall against those busy steps moves its time per token).
Each round's own time-per-token ratio is printed too (the spread; with the cores the hypervisor took
from the host in its waves, where it took some, and the json_schema wave's sit-outs, where a slow
grammar's rows sat steps out), and the JSON keeps each wave's
engine phases (/v1/engine/stats) and its window, which bench/wave_steps.py matches to the steps of
a server started with LLGTRT_STEP_LOG, and the host's CPU over the wave in cores' worth (`cpu`: all
cores busy, and by role: the engine process, the API workers, this benchmark's clients, other;
the batch's line prints the waves' median of cores busy), to tell a host out of cores from a slow
engine; each batch's plain and json_schema waves' host time follows its line (bench/host_phases.py).

    python bench/constrained_tbt.py --batch 1,8 --max-tokens 32                       # CPU
    python bench/constrained_tbt.py --bentoml-home /tmp/llama-home --model llama3-8b-random \
        --max-batch-size 256 --max-model-len 2048 --batch 1,8,64,128 --data .serve_whl/maskbench   # GPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_phases import host_ranges  # noqa: E402
from measure import cpu_used, host_cpu, percentile  # noqa: E402
from http_load import (  # noqa: E402
    ClientProcesses,
    Histogram,
    StreamResult,
    add_server_arguments,
    default_processes,
    engine_stats,
    machine,
    ms,
    new_client,
    per_step,
    read_histogram,
    run_main,
    scrape_metrics,
    served_model,
    server_url,
    stream_chat,
)

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "maskbench"
MASK_FILL = "llgtrt:grammar_mask_fill_seconds"
BATCH1_ROUNDS = 12
STOLEN_SHOWN = 0.05  # cores a wave lost to the hypervisor from which a round's line names them (calm waves: 0.00-0.01)


def schema_candidates(data: Path, max_chars: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """(file name, schema) of MaskBench schemas whose text is at most `max_chars` (0: any), shuffled by
    `seed`. `data` is the MaskBench folder or a pool of it (`write_pool`: one {"name", "schema"} per
    line, gzip)."""
    candidates = []
    for name, schema in _read_schemas(data):
        if isinstance(schema, dict) and (not max_chars or len(json.dumps(schema)) <= max_chars):
            candidates.append((name, schema))
    random.Random(seed).shuffle(candidates)
    return candidates


def _read_schemas(data: Path) -> Iterator[tuple[str, Any]]:
    if data.is_dir():
        for path in sorted(data.glob("*.json")):
            yield path.name, json.loads(path.read_text()).get("schema")
        return
    with gzip.open(data, "rt") as lines:
        for line in lines:
            item = json.loads(line)
            yield item["name"], item["schema"]


def write_pool(data: Path, out: Path) -> int:
    """Every MaskBench schema, without its test instances, in one gzip file (5 MB instead of 112):
    what a device call carries, so each run still draws from the whole pool."""
    count = 0
    with gzip.open(out, "wt") as lines:
        for name, schema in _read_schemas(data):
            if isinstance(schema, dict):
                lines.write(json.dumps({"name": name, "schema": schema}) + "\n")
                count += 1
    return count


PROMPT_SCHEMA_CHARS = 1000


def chat_body(model: str, schema: dict[str, Any], max_tokens: int, constrained: bool) -> dict[str, Any]:
    """The prompt quotes the schema's first PROMPT_SCHEMA_CHARS characters, so that any schema of the
    pool fits the context (a 9 KB one, the pool's 90th percentile, is ~2,500 Llama 3 tokens); the
    constraint is always the whole schema."""
    prompt = f"Answer with one JSON object that follows this JSON schema:\n{json.dumps(schema)[:PROMPT_SCHEMA_CHARS]}"
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "maskbench", "schema": schema, "strict": True}}
    return body


def plain_twin(model: str, schema: dict[str, Any], max_tokens: int, answer: StreamResult) -> dict[str, Any]:
    """The unconstrained request of a constrained one that gave `answer`: the same prompt, writing
    exactly as many tokens as that answer (ignore_eos), so that both waves do the same work but for
    the masks (unpaired, every plain row ran to max_tokens while a constrained answer may end after
    a few tokens, living only through its wave's busiest steps: docs/benchmarks/engine.md)."""
    body = chat_body(model, schema, max_tokens, constrained=False)
    if answer.error is None and answer.tokens > 0:
        body.update(max_tokens=answer.tokens, ignore_eos=True)
    return body


async def compiling_schemas(client: httpx.AsyncClient, url: str, model: str, count: int,
                            candidates: list[tuple[str, dict[str, Any]]], budget_s: float
                            ) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[Optional[float], float]], int]:
    """The first `count` candidates the server accepts; for each, the TTFT of the same prompt sent
    unconstrained and then with its schema seen for the first time (grammar compile included), both
    max_tokens 1: the unconstrained one also warms the server up for that prompt's shapes, so the
    difference is the compile's; and how many schemas the server refused."""
    kept, first_ttfts, refused = [], [], 0
    deadline = time.monotonic() + budget_s
    for name, schema in candidates:
        if len(kept) == count or time.monotonic() > deadline:
            break
        # Unconstrained, a random-weight model may answer with a special token only: no content, no TTFT.
        plain = await stream_chat(client, url, chat_body(model, schema, 1, constrained=False))
        result = await stream_chat(client, url, chat_body(model, schema, 1, constrained=True))
        if result.error is None and result.ttft is not None:
            kept.append((name, schema))
            first_ttfts.append((plain.ttft, result.ttft))
        elif result.error and result.error.startswith("HTTP 400"):
            refused += 1
            print(f"refused {name}: {result.error}", flush=True)
        else:
            raise RuntimeError(f"{name}: {result.error or 'no content chunk'}")
    if len(kept) < count:
        raise RuntimeError(f"only {len(kept)} of {count} schemas compiled within {budget_s} s")
    return kept, first_ttfts, refused


async def mask_fill(client: httpx.AsyncClient, url: str) -> Histogram:
    return read_histogram(await scrape_metrics(client, url), MASK_FILL)


def time_per_output_token(result: StreamResult) -> float:
    """First to last content chunk over the tokens after the first: unlike the gaps between chunks,
    it does not depend on how many tokens one chunk carries (forced tokens may share one)."""
    return sum(result.gaps) / (result.tokens - 1) if result.tokens > 1 else float("nan")


def steady_time_per_chunk(wave: list[StreamResult]) -> list[float]:
    """Each request's mean gap between content chunks once every request of its wave has its first
    one: the decode steps the whole wave shares, without the prefills of requests that arrived later
    (a wave's prompts are admitted over several steps, and a long prefill step stalls the rows
    already decoding by up to seconds, for constrained and unconstrained rows alike but at random
    points of their output). time.perf_counter is the machine's monotonic clock, one for all the
    client processes."""
    ok = [r for r in wave if r.error is None and r.chunk_times]
    if not ok:
        return []
    start = max(r.chunk_times[0] for r in ok)
    means = []
    for r in ok:
        times = [t for t in r.chunk_times if t >= start]
        if len(times) > 1:
            means.append((times[-1] - times[0]) / (len(times) - 1))
    return means


def wave_stats(plain: list[StreamResult], constrained: list[StreamResult]) -> dict[str, float]:
    """One round's constrained / unconstrained time per output token and TTFT p50 difference: the
    spread between rounds, which the pooled medians hide."""
    def tpot(wave: list[StreamResult]) -> float:
        return percentile([time_per_output_token(r) for r in wave if r.error is None and r.tokens > 1], 50)

    def ttft(wave: list[StreamResult]) -> float:
        return percentile([r.ttft for r in wave if r.error is None and r.ttft is not None], 50)

    return {"tpot_ratio": tpot(constrained) / tpot(plain), "ttft_overhead_p50": ttft(constrained) - ttft(plain)}


def stats(results: list[StreamResult], waves: list[list[StreamResult]]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    gaps = [g for r in ok for g in r.gaps]
    return {"tbt_p50": percentile(gaps, 50),
            "tbt_percentiles": [percentile(gaps, q) for q in range(1, 100)],  # the distribution, for --plot
            "tbt_p99": percentile(gaps, 99),
            "tpot_p50": percentile([time_per_output_token(r) for r in ok if r.tokens > 1], 50),
            "steady_tpc_p50": percentile([m for wave in waves for m in steady_time_per_chunk(wave)], 50),
            "tokens_per_chunk": sum(r.tokens for r in ok) / max(sum(r.chunks for r in ok), 1),
            "ttft_p50": percentile([r.ttft for r in ok if r.ttft is not None], 50),
            "tokens_per_request": sum(r.tokens for r in ok) / max(len(ok), 1),
            "errors": len(results) - len(ok),
            "error_samples": sorted({r.error for r in results if r.error})[:3]}


async def measure_batch(client: httpx.AsyncClient, pool: ClientProcesses, url: str, model: str, batch: int,
                        rounds: int, schemas: list[tuple[str, dict[str, Any]]], max_tokens: int,
                        control: bool = False) -> dict[str, Any]:
    """control: the first wave of each round is unconstrained too (an A/A run: the ratios' noise)."""
    waves: dict[bool, list[list[StreamResult]]] = {False: [], True: []}
    engine: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    mask_before = await mask_fill(client, url)
    # Batch 1's TTFT overhead is the goal resolved there: more than a few samples of it.
    for round_index in range(rounds if batch > 1 else max(rounds, BATCH1_ROUNDS)):
        # Each round takes the next `batch` schemas: batch 1 does not rest on one schema's answer length.
        picked = [schemas[(round_index * batch + i) % len(schemas)][1] for i in range(batch)]
        first = [chat_body(model, s, max_tokens, constrained=not control) for s in picked]
        for is_constrained in (True, False):  # the constrained answers first: the plain twins match their lengths
            bodies = first if is_constrained else [
                plain_twin(model, s, max_tokens, answer) for s, answer in zip(picked, waves[True][-1])]
            before, cpu_before, started = await engine_stats(client, url), host_cpu(), time.perf_counter()
            waves[is_constrained].append((await pool.run(url, bodies))[0])
            # perf_counter is the machine's monotonic clock: the window finds the wave in a step log.
            window = {"started": started, "ended": time.perf_counter(), "cpu": cpu_used(cpu_before, host_cpu())}
            engine[is_constrained].append({**per_step(before, await engine_stats(client, url)), **window})
    mask = (await mask_fill(client, url)).minus(mask_before)
    off, on = (stats([r for wave in waves[kind] for r in wave], waves[kind]) for kind in (False, True))
    by_round = [wave_stats(plain_wave, constrained_wave) for plain_wave, constrained_wave in zip(waves[False], waves[True])]
    return {"batch": batch, "unconstrained": off, "constrained": on, "rounds": by_round,
            "engine_by_round": {"unconstrained": engine[False], "constrained": engine[True]},
            "tbt_ratio": on["tbt_p50"] / off["tbt_p50"], "tpot_ratio": on["tpot_p50"] / off["tpot_p50"],
            "steady_tpc_ratio": on["steady_tpc_p50"] / off["steady_tpc_p50"],
            "ttft_overhead_p50": on["ttft_p50"] - off["ttft_p50"],
            "mask_fill_mean": mask.mean(), "mask_fill_steps": mask.count,
            **{f"{key}_p50": {("constrained" if kind else "unconstrained"): percentile(
                [wave["cpu"][key] for wave in engine[kind]], 50) for kind in (False, True)}
               for key in ("cores_busy", "steal")}}


def rounds_text(row: dict[str, Any]) -> str:
    """Each round's time-per-token ratio, with the cores the hypervisor took from the host in its waves
    where it took some (a round that lost them runs slow: engine.md, sessions 20 and 31) and the
    json_schema wave's sit-outs (draws dropped: a slow grammar's mask, filled apart, was late)."""
    texts = []
    for index, wave in enumerate(row["rounds"]):
        stolen = max(row["engine_by_round"][kind][index]["cpu"]["steal"] for kind in ("unconstrained", "constrained"))
        sit_outs = row["engine_by_round"]["constrained"][index].get("sit_outs", 0)
        notes = ([f"{stolen:.2f} cores stolen"] if stolen >= STOLEN_SHOWN else []) + (
            [f"{sit_outs} sit-outs"] if sit_outs else [])
        texts.append(f"{wave['tpot_ratio']:.3f}" + (f" ({', '.join(notes)})" if notes else ""))
    return ", ".join(texts)


def plot_tbt(rows: list[dict[str, Any]], path: Path) -> None:
    """TBT distributions (percentiles 1-99), constrained against unconstrained, one color per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    quantiles = list(range(1, 100))
    for color, r in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], rows):
        for kind, style in (("unconstrained", "-"), ("constrained", "--")):
            ax.plot([1e3 * t for t in r[kind]["tbt_percentiles"]], quantiles, style, color=color,
                    label=f"batch {r['batch']}, {kind}")
    ax.set_xscale("log")
    ax.set_xlabel("time between chunks (ms)")
    ax.set_ylabel("percentile")
    ax.set_title("TBT through the HTTP server, json_schema requests against plain ones")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n| batch | TBT p50 unconstrained ms | TBT p50 constrained ms | ratio | TBT p99 unc. / con. ms | "
          "time per output token p50 unc. / con. ms | ratio | steady time per chunk p50 unc. / con. ms | ratio | "
          "tokens per chunk unc. / con. | "
          "TTFT p50 unconstrained ms | TTFT p50 constrained ms | TTFT overhead p50 ms | mask fill per step ms | "
          "tokens/request unc. / con. | errors |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        off, on = r["unconstrained"], r["constrained"]
        print(f"| {r['batch']} | {ms(off['tbt_p50'])} | {ms(on['tbt_p50'])} | {r['tbt_ratio']:.3f} | "
              f"{ms(off['tbt_p99'])} / {ms(on['tbt_p99'])} | {ms(off['tpot_p50'])} / {ms(on['tpot_p50'])} | "
              f"{r['tpot_ratio']:.3f} | {ms(off['steady_tpc_p50'])} / {ms(on['steady_tpc_p50'])} | "
              f"{r['steady_tpc_ratio']:.3f} | {off['tokens_per_chunk']:.2f} / {on['tokens_per_chunk']:.2f} | {ms(off['ttft_p50'])} | {ms(on['ttft_p50'])} | "
              f"{r['ttft_overhead_p50'] * 1e3:+.1f} | {1e3 * r['mask_fill_mean']:.3f} | "
              f"{off['tokens_per_request']:.1f} / {on['tokens_per_request']:.1f} | "
              f"{off['errors'] + on['errors']} |")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    batches = [int(b) for b in args.batch.split(",")]
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"seed {seed}", flush=True)
    candidates = schema_candidates(args.data, args.max_schema_chars, seed)
    with server_url(args) as url:
        async with new_client(4, args.request_timeout) as client:
            model = await served_model(client, url)
            started = time.perf_counter()
            schemas, first_ttfts, refused = await compiling_schemas(
                client, url, model, min(max(batches), args.schemas), candidates, args.compile_budget)
            first_sight = [constrained for _, constrained in first_ttfts]
            compile_added = [constrained - plain for plain, constrained in first_ttfts if plain is not None]
            print(f"{machine()}; {len(schemas)} schemas compiled ({refused} refused with 400) in "
                  f"{time.perf_counter() - started:.1f} s; first-sight TTFT (compile included) "
                  f"p50 {ms(percentile(first_sight, 50))} ms, max {ms(max(first_sight))} ms; over the same prompt "
                  f"unconstrained: p50 {ms(percentile(compile_added, 50))} ms, p90 "
                  f"{ms(percentile(compile_added, 90))} ms", flush=True)
            pool = ClientProcesses(args.client_processes or default_processes(max(batches)), args.request_timeout)
            rows = []
            try:
                for batch in batches:
                    started = time.perf_counter()
                    rows.append(await measure_batch(client, pool, url, model, batch, args.rounds, schemas,
                                                    args.max_tokens, args.control))
                    r = rows[-1]
                    by_round = rounds_text(r)
                    print(f"{'A/A control, ' if args.control else ''}batch {batch}: "
                          f"{time.perf_counter() - started:.1f} s, TBT ratio {r['tbt_ratio']:.3f}, "
                          f"time per output token ratio {r['tpot_ratio']:.3f} (steady {r['steady_tpc_ratio']:.3f}), "
                          f"TTFT overhead p50 {r['ttft_overhead_p50'] * 1e3:+.1f} ms; time per output token ratio "
                          f"by round: {by_round}; cores busy p50 plain / constrained "
                          f"{r['cores_busy_p50']['unconstrained']:.1f} / {r['cores_busy_p50']['constrained']:.1f} "
                          f"of {os.cpu_count()} (stolen by the hypervisor {r['steal_p50']['unconstrained']:.2f} / "
                          f"{r['steal_p50']['constrained']:.2f})", flush=True)
                    for kind, label in (("unconstrained", "plain"), ("constrained", "json_schema")):
                        phases = [wave["phases"] for wave in r["engine_by_round"][kind] if wave.get("phases")]
                        if phases:
                            print(f"  {label} waves' host, ms a step: {host_ranges(phases)}", flush=True)
            finally:
                pool.close()
    print_table(rows)
    if args.plot:
        plot_tbt(rows, args.plot)
    print(f"load average after: {machine()}")
    return {"seed": seed, "client_processes": pool.processes, "schemas": [name for name, _ in schemas],
            "first_sight_ttft": first_ttfts, "rows": rows}  # (unconstrained, constrained) per schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--batch", default="1,8", help='concurrency levels, e.g. "1,8,64,128" on a GPU')
    parser.add_argument("--rounds", type=int, default=3, help="waves of each kind per batch size")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--schemas", type=int, default=128, help="distinct schemas (at most the largest batch)")
    parser.add_argument("--max-schema-chars", type=int, default=0,
                        help="draw only schemas of at most this many characters (default 0: the whole pool)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MaskBench folder or a .jsonl.gz pool")
    parser.add_argument("--seed", type=int, default=None, help="schema draw (default: random, printed)")
    parser.add_argument("--write-pool", type=Path, default=None,
                        help="write every schema of --data to this .jsonl.gz and exit")
    parser.add_argument("--compile-budget", type=float, default=300, help="seconds for finding the schemas")
    parser.add_argument("--plot", type=Path, default=None, help="write the TBT distributions here (PNG)")
    parser.add_argument("--control", action="store_true",
                        help="A/A: the 'constrained' waves are unconstrained too, so each ratio shows the noise alone")
    if "--write-pool" in sys.argv:
        args, _ = parser.parse_known_args()
        print(f"{write_pool(args.data, args.write_pool)} schemas written to {args.write_pool}")
        return
    run_main(parser, main_async)


if __name__ == "__main__":
    main()
