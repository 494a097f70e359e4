"""Take CPU away from the host as a hypervisor does: one core at a time stands still for a few
milliseconds, and whatever thread ran there waits. Issue 15's misses came where the hypervisor took
0.3 cores or more from the GPU machine's host (docs/benchmarks/engine.md, sessions 20, 31 and 32),
which it does on some machines at some times only; run beside the benchmark, this takes it on demand
(`bash bench/gpu_run.sh thief`).

Each of --workers processes repeats: move to a core drawn at random, spin there for --burst-ms at
real-time priority (SCHED_FIFO: the thread that ran on that core is put aside, as on a vCPU the
hypervisor paused, until the scheduler moves it; without the privilege at the default priority,
where it only competes), then sleep, for --cores cores' worth taken on average. A wave's CPU taken
this way shows in bench/constrained_tbt.py's `cpu` as `other`.

    python3 bench/cpu_thief.py --cores 2 --burst-ms 4 --seconds 60
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import random
import signal
import time


def take_cpu(cores: float, burst_s: float, seconds: float, seed: int, spun: "multiprocessing.Value") -> None:
    """One worker: bursts of `burst_s` on random cores, `cores` of a core on average."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:  # no CAP_SYS_NICE: it competes at its default priority
        pass
    allowed = sorted(os.sched_getaffinity(0))
    draw = random.Random(seed)
    mean_gap = burst_s * (1 / min(cores, 1.0) - 1)  # a burst, then this on average: `cores` busy
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        os.sched_setaffinity(0, {draw.choice(allowed)})
        start = time.perf_counter()
        while time.perf_counter() - start < burst_s:
            pass
        with spun.get_lock():
            spun.value += time.perf_counter() - start
        if mean_gap > 0:
            time.sleep(draw.expovariate(1 / mean_gap))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=float, default=2.0, help="cores' worth taken on average")
    parser.add_argument("--burst-ms", type=float, default=4.0, help="how long one core stands still")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3600.0, help="or until SIGTERM / SIGINT")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if args.cores > args.workers:  # else the share above a core each would silently not be taken
        parser.error(f"--cores {args.cores} needs --workers {math.ceil(args.cores)} or more: a worker takes one core at most")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    print(f"cpu_thief: seed {seed}, {args.cores} cores in bursts of {args.burst_ms} ms, {args.workers} workers",
          flush=True)
    spun = multiprocessing.Value("d", 0.0)
    workers = [multiprocessing.Process(target=take_cpu, args=(args.cores / args.workers, args.burst_ms / 1e3,
                                                             args.seconds, seed + i, spun), daemon=True)
               for i in range(args.workers)]
    started = time.monotonic()
    for worker in workers:
        worker.start()

    def stop(*_: object) -> None:
        for worker in workers:
            worker.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for worker in workers:
        worker.join()
    print(f"cpu_thief: took {spun.value / (time.monotonic() - started):.2f} cores over "
          f"{time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
