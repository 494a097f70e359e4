"""bench/thread_pauses.py, which stops one running thread of a process at a time as a paused vCPU
would: the thread stands still for the pause, its process's other threads run on, and every
thread runs again once the tool ends. On a real child process with ptrace (the tool's own means)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "thread_pauses.py"

# Two threads: one hashing (in C without the GIL: running, so the tool's to draw) and one waking
# every millisecond; each writes down when it got on. Their timestamps come out as JSON.
CHILD = """
import hashlib, json, sys, threading, time
data, stop = b"x" * 65536, time.perf_counter() + float(sys.argv[1])
hashing, waking = [], []
def hash_on():
    while time.perf_counter() < stop:
        hashlib.sha256(data).digest()
        hashing.append(time.perf_counter())
thread = threading.Thread(target=hash_on)
thread.start()
print("started", flush=True)
while time.perf_counter() < stop:
    time.sleep(0.001)
    waking.append(time.perf_counter())
thread.join()
print(json.dumps({"hashing": hashing, "waking": waking}))
"""

PAUSE_S = 0.1


def gaps(stamps: list[float], at_least: float) -> list[tuple[float, float]]:
    return [(a, b) for a, b in zip(stamps, stamps[1:]) if b - a >= at_least]


def start_child(script: str, seconds: float) -> subprocess.Popen:
    """`script` in a child process (run from the repository: it may import llgtrt_core), once it says it started."""
    child = subprocess.Popen([sys.executable, "-c", script, str(seconds)], stdout=subprocess.PIPE, text=True,
                             cwd=SCRIPT.parent.parent)
    assert child.stdout is not None and child.stdout.readline().strip() == "started"
    return child


def pause(pid: int, *args: str) -> subprocess.CompletedProcess:
    """The tool against process `pid` until it ends on its own; its closing line checked to be there."""
    pauser = subprocess.run([sys.executable, str(SCRIPT), "--pid", str(pid), "--seed", "7", *args],
                            capture_output=True, text=True, timeout=60)
    assert pauser.returncode == 0, pauser.stderr
    assert "pauses in" in pauser.stdout.splitlines()[-1], pauser.stdout
    return pauser


def test_stops_the_running_thread_alone_and_lets_it_go() -> None:
    child = start_child(CHILD, 4)
    started = time.perf_counter()
    pauser = pause(child.pid, "--cores", "0.5", "--pause-ms", str(PAUSE_S * 1e3), "--seconds", "2")
    ended = time.perf_counter()
    out, _ = child.communicate(timeout=60)
    stamps = json.loads(out.splitlines()[-1])
    pauses = int(re.search(r"(\d+) pauses in", pauser.stdout)[1])
    assert pauses >= 3, pauser.stdout
    # Each pause is a gap of its length in the hashing thread's timestamps (the waking thread is
    # asleep, not running, nearly always when a thread is drawn).
    stopped = gaps(stamps["hashing"], 0.9 * PAUSE_S)
    assert len(stopped) >= 2, (pauser.stdout, stopped)
    # Its process ran on: the waking thread got on during a pause of the hashing one.
    assert any(any(a < t < b for t in stamps["waking"]) for a, b in stopped)
    # Let go: the hashing thread ran after the tool ended, and never stood still that long since.
    assert stamps["hashing"][-1] > ended > started
    assert not gaps([t for t in stamps["hashing"] if t > ended], 0.9 * PAUSE_S)


# Two hashing threads, one named "target" as the OS sees it (llgtrt_core/os_threads.py's way).
NAMED_CHILD = """
import hashlib, sys, threading, time
from llgtrt_core.os_threads import name_os_thread
data, stop = b"x" * 65536, time.perf_counter() + float(sys.argv[1])
def hash_on(name):
    name_os_thread(name)
    while time.perf_counter() < stop:
        hashlib.sha256(data).digest()
threads = [threading.Thread(target=hash_on, args=(name,)) for name in ("target", "other")]
for thread in threads:
    thread.start()
print("started", flush=True)
for thread in threads:
    thread.join()
"""


def test_stops_only_the_threads_named() -> None:
    child = start_child(NAMED_CHILD, 4)
    pauser = pause(child.pid, "--threads", "^target$", "--cores", "0.5", "--pause-ms", "20", "--seconds", "1.5")
    child.wait(timeout=60)
    by_thread = pauser.stdout.splitlines()[-1].split("by thread: ")[1].split("; by process tree: ")[0]
    # Only "<process>:target <pauses>": the other thread, as busy, was never drawn.
    pauses = re.search(r":target (\d+)$", by_thread)
    assert pauses is not None and ":other" not in by_thread, pauser.stdout
    assert int(pauses[1]) >= 3


# One hashing thread among 300 asleep, as the server's few running threads among hundreds.
CROWDED_CHILD = """
import hashlib, sys, threading, time
data, stop = b"x" * 65536, time.perf_counter() + float(sys.argv[1])
asleep = threading.Event()
sleepers = [threading.Thread(target=asleep.wait, daemon=True) for _ in range(300)]
for thread in sleepers:
    thread.start()
print("started", flush=True)
while time.perf_counter() < stop:
    hashlib.sha256(data).digest()
"""


def test_holds_the_share_asked_among_many_sleeping_threads() -> None:
    # Reading every thread's state before each pause held 0.21 of the 0.5 asked here.
    child = start_child(CROWDED_CHILD, 4)
    pauser = pause(child.pid, "--cores", "0.5", "--pause-ms", "4", "--seconds", "2")
    child.wait(timeout=60)
    held = float(re.search(r"\(([\d.]+) threads stopped on average\)", pauser.stdout)[1])
    assert 0.35 <= held <= 0.6, pauser.stdout


# A process that only sleeps, its child hashing: the child's pauses count for the tree's root.
PARENT_OF_HASHER = """
import subprocess, sys, time
hasher = subprocess.Popen([sys.executable, "-c", "import hashlib, sys, time\\n"
                           "stop = time.perf_counter() + float(sys.argv[1])\\n"
                           "while time.perf_counter() < stop: hashlib.sha256(b'x' * 65536).digest()", sys.argv[1]])
print("started", flush=True)
hasher.wait()
"""


def test_counts_the_pauses_by_process_tree() -> None:
    parent, hasher = start_child(PARENT_OF_HASHER, 4), start_child(CROWDED_CHILD, 4)
    pauser = pause(parent.pid, "--pid", str(hasher.pid), "--cores", "0.5", "--pause-ms", "4", "--seconds", "1.5")
    parent.wait(timeout=60)
    hasher.wait(timeout=60)
    line = pauser.stdout.splitlines()[-1]
    by_tree = dict(map(int, entry.split()) for entry in line.split("; by process tree: ")[1].split(", "))
    assert set(by_tree) == {parent.pid, hasher.pid}, line  # the grandchild's pauses under its root
    assert min(by_tree.values()) >= 3 and sum(by_tree.values()) == int(re.search(r"(\d+) pauses in", line)[1]), line
