"""Where the host's time goes in the engine's step, constrained against unconstrained, under HTTP load.

--clients closed-loop streaming clients (as bench/http_load.py) send MaskBench-schema chat requests
for --seconds, unconstrained in one window and with the schema as `response_format` in the next
(the order alternates by round). Around each window the server's /v1/engine/stats is read: the
engine thread's wall and CPU time per phase of its step loop (llgtrt_core/engine/step_profile.py)
and the mask-fill thread's, reported per step. Wall minus CPU is time the thread waited: for the
GPU (gpu_wait), for the fill thread (fill_wait), or for the GIL. With --py-spy, py-spy samples the
server's threads that hold the GIL in the middle of each window (--gil --nonblocking), and the
samples are attributed to the engine thread, the mask-fill thread, the event loop (HTTP, SSE,
detokenizing) and the rest: who holds the GIL while the engine thread waits for it.

    python3 bench/step_profile.py --bentoml-home /tmp/llama-home --model llama3-8b-random \
        --max-batch-size 256 --max-model-len 2048 --clients 128 --data .serve_whl/maskbench_pool.jsonl.gz --py-spy
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from constrained_tbt import DEFAULT_DATA, chat_body, compiling_schemas, schema_candidates  # noqa: E402
from http_load import (  # noqa: E402
    ClientProcesses,
    add_server_arguments,
    default_processes,
    engine_stats,
    machine,
    new_client,
    per_step,
    run_main,
    served_model,
    server_url,
    summarize,
)

THREAD_NAME = re.compile(r"thread \(\d+\): ([^;]*)")


def profiled_process(url: str) -> tuple[Optional[int], str]:
    """The engine process, whose engine and mask-fill threads share a GIL (an API worker listening on
    the server's port has a GIL of its own, and py-spy's --subprocesses does not reach the engine
    process from it); else the process listening on the port."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        if "llgtrt_core.engine.core_process" in (process.info["cmdline"] or []):
            return process.pid, "engine process"
    port = urlparse(url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid, "serving process"
    return None, ""


def start_py_spy(pid: int, seconds: float, out: Path) -> Optional[subprocess.Popen]:
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy not found: no GIL profile", flush=True)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--subprocesses", "--gil", "--threads",
                             "--nonblocking", "--rate", "250", "--duration", str(max(1, int(seconds))),
                             "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def gil_profile(raw: Path, sampled: str, top: int = 8) -> dict[str, Any]:
    """Samples holding the GIL, per process (each has its own GIL) and thread, and the most frequent
    frames of ours per thread (`sampled`: the process py-spy was pointed at). Pool threads count
    under their pool's name."""
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    if not raw.exists():
        return {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        # --subprocesses nests a child's stacks under its parent's "process" frame.
        processes = [f for f in stack.split(";") if f.startswith("process ")]
        process = "engine process" if any("core_process" in f for f in processes) or (
            not processes and sampled == "engine process") else "serving process"
        name = THREAD_NAME.search(stack)
        thread = re.sub(r"[-_]\d+$", "", name.group(1)) if name else "?"
        by_thread[process][thread] += int(count_text)
        ours = [f for f in stack.split(";") if "llgtrt_core" in f]
        frames[f"{process}/{thread}"][ours[-1] if ours else stack.split(";")[-1]] += int(count_text)
    return {"samples": {p: sum(c.values()) for p, c in by_thread.items()},
            "share": {p: {t: n / sum(c.values()) for t, n in c.most_common()} for p, c in by_thread.items()},
            "top_frames": {k: c.most_common(top) for k, c in frames.items()}}


async def run_window(client: httpx.AsyncClient, pool: ClientProcesses, url: str, bodies: list[dict[str, Any]],
                     seconds: float, spy_out: Optional[Path]) -> dict[str, Any]:
    before = await engine_stats(client, url)
    spy = None
    if spy_out is not None:
        pid, sampled = profiled_process(url)
        if pid is not None:
            async def spy_later() -> Optional[subprocess.Popen]:
                await asyncio.sleep(seconds * 0.3)  # past the first wave of prefills
                return start_py_spy(pid, seconds * 0.5, spy_out)
            spy = asyncio.ensure_future(spy_later())
    results, elapsed = await pool.run(url, bodies, seconds)
    after = await engine_stats(client, url)
    out = {"client": summarize(results, elapsed), **per_step(before, after)}
    if spy is not None:
        process = await spy
        if process is not None:
            await asyncio.to_thread(process.wait)
            out["gil"] = gil_profile(spy_out, sampled)
    return out


def print_phases(rows: list[dict[str, Any]]) -> None:
    names = sorted({name for r in rows for name in r["phases"]})
    print("\n| phase | " + " | ".join(f"{r['kind']} r{r['round']} wall / cpu ms" for r in rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for name in names:
        cells = []
        for r in rows:
            p = r["phases"].get(name)
            cells.append(f"{p['wall_s']:.3f} / {p['cpu_s']:.3f}" if p else "")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| steps, tok/s, TBT p50 ms | " + " | ".join(
        f"{r['steps']}, {r['client']['tokens_per_s']:.0f}, {1e3 * r['client']['tbt_p50']:.2f}" for r in rows) + " |")
    for r in rows:
        if r.get("gil"):
            for process, share in r["gil"]["share"].items():
                threads = ", ".join(f"{t} {v:.0%}" for t, v in share.items())
                print(f"GIL samples, {r['kind']} round {r['round']}, {process}: {r['gil']['samples'][process]} "
                      f"({threads})")
            for thread, top in r["gil"]["top_frames"].items():
                print(f"  {thread}: " + "; ".join(f"{frame} x{count}" for frame, count in top[:5]))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"seed {seed}", flush=True)
    candidates = schema_candidates(args.data, args.max_schema_chars, seed)
    spy_dir = Path(args.py_spy_dir or tempfile.mkdtemp(prefix="step-profile-"))
    spy_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with server_url(args) as url:
        async with new_client(4, args.request_timeout) as client:
            model = await served_model(client, url)
            schemas, _, refused = await compiling_schemas(client, url, model, args.clients, candidates,
                                                          args.compile_budget)
            print(f"{machine()}; {len(schemas)} schemas compiled ({refused} refused)", flush=True)
            bodies = {kind: [chat_body(model, schema, args.max_tokens, constrained=kind == "constrained")
                             for _, schema in schemas] for kind in ("unconstrained", "constrained")}
            pool = ClientProcesses(args.client_processes or default_processes(args.clients), args.request_timeout)
            try:
                for round_index in range(args.rounds):
                    order = ("unconstrained", "constrained") if round_index % 2 == 0 else ("constrained", "unconstrained")
                    for kind in order:
                        spy_out = spy_dir / f"gil_{kind}_{round_index}.txt" if args.py_spy else None
                        row = await run_window(client, pool, url, bodies[kind], args.seconds, spy_out)
                        rows.append({"kind": kind, "round": round_index, **row})
                        print(f"{kind} round {round_index}: {row['steps']} steps, "
                              f"{row['client']['tokens_per_s']:.0f} tok/s, errors {row['client']['errors']}",
                              flush=True)
            finally:
                pool.close()
    print_phases(rows)
    return {"seed": seed, "schemas": [name for name, _ in schemas], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20, help="per window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-schema-chars", type=int, default=0, help="0: the whole pool")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MaskBench folder or a .jsonl.gz pool")
    parser.add_argument("--seed", type=int, default=None, help="schema draw (default: random, printed)")
    parser.add_argument("--compile-budget", type=float, default=300)
    parser.add_argument("--py-spy", action="store_true", help="sample the GIL holders (needs py-spy, root)")
    parser.add_argument("--py-spy-dir", type=Path, default=None)
    run_main(parser, main_async)


if __name__ == "__main__":
    main()
