"""Latency of the shared response store's calls (several API workers), which run on the event loop.

A second process stores responses into the same SQLite file meanwhile (one every ~1 ms), as another
worker would. Per round: a store of a new response (put), a read of a random stored one (get), and
the cancel poll's query; the in-memory store of one worker on the same entries as the peer; and a
0.1 ms pure-Python spin, the box's own noise for a call that long. Entries: a 10-message
conversation and one output message, their lengths drawn at random (the seed is printed). Each line:
median, 99th percentile, worst, and how many calls took over 5 ms.

    python bench/response_store.py --seed 7 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from measure import machine  # noqa: E402  (bench/ is the script's folder)
from llgtrt_core.api.response_store import MemoryResponseStore, StoredResponse  # noqa: E402
from llgtrt_core.api.response_store_shared import SharedResponseStore  # noqa: E402
from llgtrt_core.api.responses_protocol import (MessageItem, OutputMessage, OutputTextPart,  # noqa: E402
                                               ResponseObject)


def new_entry(rng: random.Random) -> StoredResponse:
    response = ResponseObject(id=f"resp_{uuid.uuid4().hex}", model="m", status="completed")
    response.output.append(OutputMessage(id="msg", content=[OutputTextPart(text="x" * rng.randint(100, 2000))]))
    items = [MessageItem(role=("user", "assistant")[i % 2], content="y" * rng.randint(50, 500)) for i in range(10)]
    return StoredResponse(response, items)


def other_worker(path: str, seconds: float, seed: int) -> None:
    rng, store, end = random.Random(seed), SharedResponseStore(1024, 3600, path=path), time.time() + seconds
    while time.time() < end:
        store.put(new_entry(rng))
        time.sleep(0.001)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e6


def summary(name: str, micros: list[float]) -> str:
    ordered = sorted(micros)
    return (f"{name:12s} p50 {ordered[len(ordered) // 2]:6.0f} us  p99 {ordered[int(len(ordered) * 0.99)]:6.0f} us"
            f"  max {ordered[-1]:6.0f} us  over 5 ms: {sum(m > 5000 for m in micros)}")


def run_round(path: str, seed: int, calls: int) -> None:
    other = multiprocessing.get_context("spawn").Process(target=other_worker, args=(path, 30, seed + 1))
    other.start()
    try:
        time.sleep(1)  # the other process is writing
        rng = random.Random(seed)
        shared, memory = SharedResponseStore(1024, 3600, path=path), MemoryResponseStore(1024, 3600)
        times: dict[str, list[float]] = {name: [] for name in ("put", "get", "poll", "memory put", "memory get",
                                                                  "spin 0.1 ms")}
        ids: list[str] = []
        gc.disable()  # a full collection (50-140 ms here) lands in whichever call allocates: not the store's
        for _ in range(calls):
            entry = new_entry(rng)
            ids.append(entry.response.id)
            times["put"].append(timed(lambda: shared.put(entry)))
            times["memory put"].append(timed(lambda: memory.put(entry)))
            response_id = rng.choice(ids)
            times["get"].append(timed(lambda: shared.get(response_id)))
            times["memory get"].append(timed(lambda: memory.get(response_id)))
            times["poll"].append(timed(lambda: shared._connection().execute(
                "SELECT id FROM responses WHERE cancel_requested = 1").fetchall()))
            times["spin 0.1 ms"].append(timed(lambda: spin(100e-6)))
        gc.enable()
        for name, micros in times.items():
            print(summary(name, micros))
    finally:
        other.terminate()
        other.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(f"{machine()}\nseed {args.seed}")
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.rounds):
            print(f"round {i}")
            run_round(str(Path(folder) / f"round-{i}.sqlite3"), args.seed + 2 * i, args.calls)


if __name__ == "__main__":
    main()
