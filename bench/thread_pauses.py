"""Stop the running threads of some processes for a few milliseconds at a time, as a hypervisor
does when it pauses the vCPU they run on. Issue 15's misses came while the hypervisor took 0.3-1.1
cores from the GPU machine's host (docs/benchmarks/engine.md, sessions 32, 33 and 36); a thread on a
paused vCPU stands still where it is, holding what it holds (the GIL among others), and no other
core can take it over. bench/cpu_thief.py takes cores instead, and the scheduler can move the
thread it puts aside to an idle core: on a 16-core host with a few busy it reproduced the slowdown
only in part (session 35). This stops the thread itself.

Each of ceil(--cores) pausers repeats: draw one running thread (state R) of the target processes at
random (a vCPU the hypervisor pauses is one that runs something, and a busier thread is more often
the one on it), stop it with ptrace (PTRACE_SEIZE + PTRACE_INTERRUPT: that thread only, its process
runs on), hold it --pause-ms, let it go, then wait for --cores' share on average. The targets: the
processes given by --pid or whose command line matches --match (a regular expression) and all their
descendants, looked up again every second (servers restart); of their threads (those whose name
matches --threads, if given), only those that ran in the last 0.1 s are checked for one running
now. Needs ptrace rights over them (root, or their user with Yama's ptrace_scope 0). A stopped
thread is let go on SIGTERM or SIGINT, and by the kernel if this process dies. Its closing line
says what it paused: the pauses, the seconds held, the threads held at once on average (less than
--cores asks while the targets have fewer threads running, and by the time a pause takes to start
when a pauser's share is near 1) and the threads by process and name. It takes CPU itself: 0.3-0.45
cores beside the server on the GPU machine, the "other" of bench/constrained_tbt.py's cores
(session 37).

    python3 bench/thread_pauses.py --pid $(cat /tmp/server.pgid) --cores 1 --seconds 60
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import math
import os
import random
import re
import signal
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207
WALL = 0x40000000  # waitpid's __WALL: a thread of another process, traced by this one
PTRACE_EVENT_STOP = 128

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def process_tree(roots: list[int], pattern: Optional[re.Pattern[str]]) -> dict[int, int]:
    """`roots`, the processes whose command line matches `pattern` (this one aside) and every
    descendant of those, each mapped to the one of those it descends from (its tree's root)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    found = set(roots)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        children[int(stat[stat.rindex(")") + 2:].split()[1])].append(int(entry.name))  # its parent's pid
        if pattern is not None and pattern.search(command):
            found.add(int(entry.name))
    tree: dict[int, int] = {}
    todo = [(pid, pid) for pid in found]
    while todo:
        pid, root = todo.pop()
        if pid not in tree:  # a matched process under a root stays in the root's tree
            tree[pid] = root
            todo.extend((child, root) for child in children.get(pid, []))
    return tree


def threads_of(pids: Iterable[int], names: Optional[re.Pattern[str]] = None) -> list[tuple[int, int]]:
    """(pid, tid) of every thread of `pids`; with `names`, of those whose name (as the OS has it) matches."""
    threads = []
    for pid in pids:
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # gone meanwhile
            continue
        threads.extend((pid, tid) for tid in tids if names is None or names.search(comm(pid, tid)))
    return threads


def comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def cpu_ns(pid: int, tid: int) -> int:
    """The thread's CPU time so far (the scheduler's own count, exact to the nanosecond); -1 if gone."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except OSError:
        return -1


def is_running(pid: int, tid: int) -> bool:
    """Whether the thread is running or runnable now."""
    try:
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] == "R"  # the state follows the name, which may hold spaces


def thread_name(pid: int, tid: int) -> str:
    """The thread's name and its process's (the module or script it runs: Python threads mostly
    share the interpreter's name)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[1:]
    except OSError:
        return "?"
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):  # the interpreter's flags (-B, -s)
        argv = argv[1:]
    if argv and argv[0] in ("-m", "-c") and len(argv) > 1:
        process = next((line.strip() for line in argv[1].splitlines() if line.strip()), "")[:40]
    else:
        process = os.path.basename(argv[0]) if argv else "?"
    return f"{process}:{comm(pid, tid)}"


def stop_thread(tid: int) -> bool:
    """Stop thread `tid` alone (its process runs on); whether it is stopped now, traced by this one."""
    if _libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
        if ctypes.get_errno() == errno.EPERM:  # no rights, or traced by another (py-spy)
            raise PermissionError(f"ptrace refused on thread {tid}: run as root, or as its user with Yama's "
                                  "ptrace_scope 0, and with no other tracer attached")
        return False  # gone meanwhile
    if _libc.ptrace(PTRACE_INTERRUPT, tid, None, None) != 0:
        _libc.ptrace(PTRACE_DETACH, tid, None, None)
        return False
    try:
        _, status = os.waitpid(tid, WALL)
    except ChildProcessError:  # it exited meanwhile
        return False
    if os.WIFSTOPPED(status) and status >> 16 != PTRACE_EVENT_STOP:
        # A signal reached it first: the stop is that signal's delivery, which detaching passes on.
        let_go(tid, os.WSTOPSIG(status))
        return False
    return os.WIFSTOPPED(status)


def let_go(tid: int, signal_number: int = 0) -> None:
    _libc.ptrace(PTRACE_DETACH, tid, None, ctypes.c_void_p(signal_number))


class Targets:
    """The threads of the processes to pause (`process_tree`, looked up again every second) that ran
    in the last two readings of their CPU time, taken every `READ_S` on a thread of its own: a
    pauser checks only those for one running now. The server's processes have hundreds of threads,
    most asleep: reading every one's state before each pause kept 0.10-0.13 threads stopped on
    average where 1 and 2 were asked (session 37)."""

    READ_S = 0.05

    def __init__(self, roots: list[int], pattern: Optional[re.Pattern[str]],
                 names: Optional[re.Pattern[str]]) -> None:
        self._roots, self._pattern, self._names = roots, pattern, names
        self.recent: list[tuple[int, int]] = []  # replaced whole, never changed: pausers read it as it is
        self.root_of: dict[int, int] = {}  # pid -> its tree's root (`process_tree`), replaced whole too

    def watch(self, until: float, stopping: threading.Event) -> None:
        threads: list[tuple[int, int]] = []
        before: dict[tuple[int, int], int] = {}
        ran_before: set[tuple[int, int]] = set()
        looked_up = -1.0
        while time.monotonic() < until and not stopping.is_set():
            if time.monotonic() - looked_up > 1.0:
                self.root_of = process_tree(self._roots, self._pattern)
                threads = threads_of(self.root_of, self._names)
                looked_up = time.monotonic()
            now = {thread: cpu_ns(*thread) for thread in threads}
            ran = {thread for thread, ns in now.items() if ns > before.get(thread, ns)}
            self.recent = list(ran | ran_before)
            before, ran_before = now, ran
            stopping.wait(self.READ_S)


class Pauser:
    """Stops a running thread of the targets at a time, `share` of the time on average."""

    held: set[int] = set()  # threads stopped now, by any pauser: each stops its own
    held_lock = threading.Lock()

    def __init__(self, targets: Targets, share: float, pause_s: float, draw: random.Random) -> None:
        self.targets, self.share, self.pause_s, self.draw = targets, share, pause_s, draw
        self.pauses = 0
        self.held_s = 0.0
        self.by_name: collections.Counter[str] = collections.Counter()
        self.by_root: collections.Counter[int] = collections.Counter()  # pauses by process tree (its root's pid)

    def run(self, until: float, stopping: threading.Event) -> None:
        mean_gap = self.pause_s * (1 / self.share - 1)  # a pause, then this on average: `share` paused
        while time.monotonic() < until and not stopping.is_set():
            started = time.perf_counter()
            held = self.pause_one()
            if held is None:
                stopping.wait(0.0005)  # nothing running: an idle vCPU's pause costs nothing
            elif mean_gap > 0:  # less the time finding and stopping the thread took, part of the gap
                looked = time.perf_counter() - started - held
                stopping.wait(max(0.0, self.draw.expovariate(1 / mean_gap) - looked))

    def pause_one(self) -> Optional[float]:
        """Stop a running thread for the pause; the seconds it stood still, or None if none was running."""
        recent = list(self.targets.recent)
        self.draw.shuffle(recent)  # the first running one found: each running one as likely
        for pid, tid in recent:
            if tid in Pauser.held or not is_running(pid, tid):
                continue
            with Pauser.held_lock:
                if tid in Pauser.held:  # another pauser's since
                    continue
                Pauser.held.add(tid)
            break
        else:
            return None
        try:
            if not stop_thread(tid):
                return None
            started = time.perf_counter()
            time.sleep(self.pause_s)
            let_go(tid)
            held = time.perf_counter() - started
            self.held_s += held
            self.pauses += 1
            self.by_name[thread_name(pid, tid)] += 1
            self.by_root[self.targets.root_of.get(pid, pid)] += 1
            return held
        finally:
            with Pauser.held_lock:
                Pauser.held.discard(tid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--match", help="regular expression over the processes' command lines")
    parser.add_argument("--threads", help="regular expression over their threads' names (the server names those on a "
                                          "step's path: llgtrt_core/os_threads.py); default: every thread")
    parser.add_argument("--pid", type=int, action="append", help="a process to pause (repeat for more)")
    parser.add_argument("--cores", type=float, default=1.0, help="threads held stopped at once, on average")
    parser.add_argument("--pause-ms", type=float, default=4.0, help="how long one thread stands still")
    parser.add_argument("--seconds", type=float, default=3600.0, help="or until SIGTERM / SIGINT")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if not args.match and not args.pid:
        parser.error("--match or --pid: which processes")
    if args.cores <= 0 or args.pause_ms <= 0:
        parser.error("--cores and --pause-ms must be positive")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    targets = Targets(args.pid or [], re.compile(args.match) if args.match else None,
                      re.compile(args.threads) if args.threads else None)
    count = math.ceil(args.cores)
    pausers = [Pauser(targets, args.cores / count, args.pause_ms / 1e3, random.Random(seed + i)) for i in range(count)]
    print(f"thread_pauses: seed {seed}, {args.cores} threads stopped at once on average, {args.pause_ms} ms each, "
          f"{count} pausers; processes {args.pid or []}, those matching {args.match!r} and their descendants; "
          f"threads named {args.threads or 'anything'}", flush=True)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    until = time.monotonic() + args.seconds
    started = time.perf_counter()
    threading.Thread(target=targets.watch, args=(until, stopping), daemon=True).start()
    threads = [threading.Thread(target=p.run, args=(until, stopping), daemon=True) for p in pausers]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        stopping.wait(0.2)  # the main thread takes the signals
    elapsed = time.perf_counter() - started
    pauses, held = sum(p.pauses for p in pausers), sum(p.held_s for p in pausers)
    names = sum((p.by_name for p in pausers), collections.Counter())
    roots = sum((p.by_root for p in pausers), collections.Counter())
    print(f"thread_pauses: {pauses} pauses in {elapsed:.1f} s, {held:.2f} s held ({held / max(elapsed, 1e-9):.2f} "
          f"threads stopped on average); by thread: "
          + ", ".join(f"{name} {n}" for name, n in names.most_common(12))
          + "; by process tree: " + ", ".join(f"{root} {n}" for root, n in sorted(roots.items())), flush=True)


if __name__ == "__main__":
    main()
