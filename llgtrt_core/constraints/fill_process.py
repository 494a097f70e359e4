"""The mask fill in a process of its own: the commits, masks and loop guards of every constrained
row, out of the engine process's GIL (docs/architecture.md says why).

The engine process keeps a `RemoteMaskPostProcessor`: the constraint stage calls it as it calls
`MaskPostProcessor` (same threads, same futures), but each fill is one message to the fill process
and its answer. The fill begun ahead is the engine thread's own: it sends the rows as it reads the
step's draw (`send_fill`) and takes the answer when the next step wants the masks, so no thread of
the engine process waits for the GIL to pass them on (in the server the round trip of a fill
thread's took 1.3-2 ms longer than the fill, of which ~0.5 ms on a quiet host: engine.md "Session 35"). The fill process holds a matcher and loop guard per constraint, built from the
grammar text with its own compiler (hinted at each new grammar the engine process compiles, so the
two compile at once), and its own `MaskPostProcessor`, whose host buffer is shared memory that the
engine process's buffer also is (pinned there on CUDA): the masks it computes are where the upload
copies them from. A row's first fill carries what the row needs there (its grammar text, loop
guard, the tokens forced at its start); an answer carries the rows that failed (their errors) and
those near their length limit (`closing`). A finished request's constraint is dropped with the
next fill. Fast-forward past the start is not offered: every sampled token is committed by a fill.
A fill process that dies or goes silent is replaced (`_replaced`): the constraints it held fail,
later requests are served as before.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.shared_memory import SharedMemory
from typing import Optional, Sequence

import torch
from llguidance.torch import get_bitmask_shape

from llgtrt_core import metrics
from llgtrt_core.config import LlguidanceConfig
from llgtrt_core.constraints.grammar import GrammarCompiler, GrammarConstraint, build_ll_tokenizer
from llgtrt_core.constraints.postprocessor import MaskPool, MaskPostProcessor
from llgtrt_core.engine.interface import ConstrainedRow, Constraint, LoopGuardSettings
from llgtrt_core.engine.step_profile import StepPhases

logger = logging.getLogger(__name__)

# A row on the wire: (constraint id, token to commit or None, what a new constraint needs or None).
# A new constraint: (grammar text, loop guard settings or None, (limit, stop token ids) of its start
# commit or None, its error or None).
NewConstraint = tuple[str, Optional[LoopGuardSettings], Optional[tuple[int, frozenset[int]]], Optional[str]]
WireRow = tuple[int, Optional[int], Optional[NewConstraint]]
# An answer: (row position -> error, positions near their length limit, the fill's seconds there).
Outcome = tuple[dict[int, str], list[int], float]
# A fill's answer takes milliseconds (a row's first fill may compile its grammar there, within the
# parser limits): a process silent this long is taken for stuck and replaced, rather than the engine
# waiting for it for good.
ANSWER_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class FillSpec:
    """What the fill process builds its compiler and post-processor from."""

    model_dir: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    llguidance: LlguidanceConfig
    capacity: int  # rows of the shared mask buffer: the engine's batch
    shared_name: str
    address: str  # Unix socket the engine process's threads connect to


def shared_masks(shared: SharedMemory, capacity: int, vocab_size: int) -> torch.Tensor:
    """The mask buffer both processes see in `shared`: (capacity, words) int32, as llguidance lays it out."""
    shape = get_bitmask_shape(capacity, vocab_size)
    return torch.frombuffer(shared.buf, dtype=torch.int32, count=math.prod(shape)).view(shape)


class RemoteMaskPostProcessor(MaskPostProcessor):
    """The engine process's side: `MaskPostProcessor` whose fills run in the fill process."""

    forwards_each_token = False

    def __init__(self, spec: FillSpec, ll_tokenizer, shared: SharedMemory, process: multiprocessing.Process) -> None:
        host = shared_masks(shared, spec.capacity, ll_tokenizer.vocab_size)
        self._pinned = False
        if torch.cuda.is_available():  # the upload copies straight from it, asynchronously
            status = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * 4, 0)
            self._pinned = int(status) == 0
            if not self._pinned:
                logger.warning("the shared mask buffer could not be pinned (CUDA error %s): uploads wait", int(status))
        super().__init__(ll_tokenizer, spec.capacity, num_threads=1, host_masks=host)
        self.spec = spec
        self._shared = shared
        self._process = process
        self._generation = 0  # the fill process's: each replacement (`_replaced`) counts one
        self._replacing = threading.Lock()
        self.answer_timeout_s = ANSWER_TIMEOUT_S
        self._local = threading.local()  # each calling thread's `_Link` (fill thread, apart threads, engine thread)
        self._lock = threading.Lock()  # the ids below
        self._ids: dict[int, int] = {}  # id(constraint) -> its id in the fill process, once sent
        self._held: dict[int, Constraint] = {}  # by id(constraint): held, so that no other object takes its id
        self._starts: dict[int, tuple[int, frozenset[int]]] = {}  # id(constraint) -> its start commit's arguments
        self._dropped: list[int] = []
        self._next_id = 0
        self._hints = self._connect()  # `precompile`'s, under `_lock`

    @classmethod
    def start(cls, model_dir: str, ll_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
              guidance: LlguidanceConfig, capacity: int, address: str) -> "RemoteMaskPostProcessor":
        """Start the fill process and connect to it."""
        shared = SharedMemory(create=True, size=math.prod(get_bitmask_shape(capacity, ll_tokenizer.vocab_size)) * 4)
        spec = FillSpec(model_dir, vocab_size, tuple(eos_token_ids), guidance, capacity, shared.name, address)
        try:
            process = _spawn(spec)
        except RuntimeError:
            shared.unlink()
            raise
        return cls(spec, ll_tokenizer, shared, process)

    def precompile(self, grammar: str) -> None:
        """The fill process compiles `grammar` now, as the engine process does (any thread)."""
        with self._lock:
            try:
                self._hints.send(("compile", grammar))
            except OSError:  # the process is gone: its replacement compiles the grammar at its first fill
                pass

    def release(self, constraint: Constraint) -> None:
        """`constraint`'s request finished: the fill process drops it with the next fill."""
        with self._lock:
            self._starts.pop(id(constraint), None)
            self._held.pop(id(constraint), None)
            remote = self._ids.pop(id(constraint), None)
            if remote is not None:
                self._dropped.append(remote)

    def close(self) -> None:
        """Stop the fill process and free the shared buffer (still mapped here: tensors view it)."""
        self._process.kill()
        self._process.join(10)
        if self._pinned:  # else a later buffer mapped at these addresses cannot be pinned (CUDA error 712)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._host_masks.data_ptr())
            self._pinned = False
        self._shared.unlink()

    def commit_with_forced(self, constraint: Constraint, token: Optional[int], limit: int,
                           stop_token_ids: frozenset[int] = frozenset()) -> list[int]:
        """At a request's start only (`forwards_each_token` is False): the tokens its grammar forces
        first, committed here and, with its first fill, there."""
        if token is not None:
            raise RuntimeError("the fill process commits every sampled token itself")
        forced = super().commit_with_forced(constraint, None, limit, stop_token_ids)
        with self._lock:
            self._starts[id(constraint)] = (limit, stop_token_ids)
        return forced

    def _fill_rows(self, rows: Sequence[ConstrainedRow], host: torch.Tensor, pool: MaskPool,
                   phases: Optional[StepPhases] = None) -> None:
        offset = (host.data_ptr() - self._host_masks.data_ptr()) // self._row_bytes
        self._apply(rows, self._exchange(("fill", offset), rows))
        if phases is not None:
            phases.mark("remote")

    def send_fill(self, rows: Sequence[ConstrainedRow]) -> "SentFill":
        """`fill(rows)` sent from the calling thread, which has the rows' tokens in hand (the engine
        thread, as it reads a step's draw), its answer taken when `result` is called (on that thread
        too): no thread of this process waits for the GIL to send the rows or to take the answer."""
        self._reserve(len(rows), keep=0)
        self.phases.begin()
        try:
            link = self._exchange(("fill", 0), rows, answer=False)
            return SentFill(self, rows, link, None, time.perf_counter())
        except RuntimeError as e:
            return SentFill(self, rows, None, e)

    def fill_apart(self, rows: Sequence[ConstrainedRow]) -> torch.Tensor:
        try:
            masks, outcome = self._exchange(("apart",), rows)
        except RuntimeError as e:  # as in-process: the rows fail, nothing raises
            logger.error("mask fill apart failed: %s", e)
            return self._failed_apart(rows, e)
        self._apply(rows, outcome)
        return torch.frombuffer(bytearray(masks), dtype=torch.int32).view(len(rows), -1)

    def _wire(self, rows: Sequence[ConstrainedRow]) -> tuple[int, tuple[list[int], list[WireRow]], list[int]]:
        """The dropped constraints and `rows` as the fill process takes them, with the generation of
        the process they are for and the constraints (by id) they introduce there."""
        wire: list[WireRow] = []
        introduced: list[int] = []
        with self._lock:
            dropped, self._dropped = self._dropped, []
            for row in rows:
                key = id(row.constraint)
                remote = self._ids.get(key)
                new = None
                if remote is None:
                    remote = self._ids[key] = self._next_id
                    self._next_id += 1
                    self._held[key] = row.constraint
                    introduced.append(key)
                    grammar: GrammarConstraint = row.constraint  # type: ignore[assignment]
                    guard = grammar.loop_guard.settings if grammar.loop_guard is not None else None
                    # Kept until `release`: a replacement process may need the row's start again.
                    new = (grammar.grammar, guard, self._starts.get(key), grammar.error)
                wire.append((remote, row.new_token, new))
            return self._generation, (dropped, wire), introduced

    def _apply(self, rows: Sequence[ConstrainedRow], outcome: Outcome) -> None:
        errors, closing, _ = outcome
        for j, message in errors.items():
            rows[j].constraint.fail(message)
        for j in closing:
            rows[j].constraint.closing = True  # type: ignore[attr-defined]

    def _exchange(self, head: tuple, rows: Sequence[ConstrainedRow], answer: bool = True) -> object:
        """The message `head` + `rows` wired (`_wire`) sent on the calling thread's connection (the fill
        process answers each in order), and its answer (or, answer False, the link to take it on). A
        process found gone, before or after it took the message, or silent, is replaced and the
        message sent to the new one once more: the rows it introduced start there afresh, those it
        held before fail with the error (their matchers were there)."""
        for _ in range(2):
            generation, wired, introduced = self._wire(rows)
            try:
                link = self._send(generation, (*head, wired))
                return self._receive(link) if answer else link
            except _Gone as gone:
                error = self._replaced(generation, str(gone), spare=introduced)
        raise error

    def _send(self, generation: int, message: tuple) -> "_Link":
        try:
            link = getattr(self._local, "link", None)
            if link is None or link.generation != generation:  # first use, or the process was replaced
                link = self._local.link = _Link(self._connect(), generation)
            link.conn.send(message)
        except (EOFError, OSError) as e:
            raise _Gone(f"the mask fill process is gone: {e}") from e
        return link

    def _receive(self, link: "_Link", phases: Optional[StepPhases] = None, sent: float = 0.0) -> object:
        """The fill process's answer on `link`; its failure raised (`_Gone`: it is gone or silent).
        With `phases`: the round trip from `sent` in three spans (to the fill process, there, back:
        each includes its waits)."""
        try:
            if not link.conn.poll(self.answer_timeout_s):
                raise _Gone(f"the mask fill process did not answer within {self.answer_timeout_s:g} s")
            kind, answer, received, answered = link.conn.recv()
        except (EOFError, OSError) as e:
            raise _Gone(f"the mask fill process is gone: {e}") from e
        if phases is not None:
            phases.add("remote_to", received - sent)
            phases.add("remote_there", answered - received)
            phases.add("remote_back", time.perf_counter() - answered)
        if kind == "error":
            raise RuntimeError(f"the mask fill process failed: {answer}")
        return answer

    def _replaced(self, generation: int, why: str, spare: Sequence[int] = ()) -> RuntimeError:
        """The fill process of `generation` failed (`why`); unless a thread saw to it already, the
        constraints it held fail with `why` (their matchers were there), but for `spare` (by id:
        those the failed message introduced, sent again), and a fresh process takes the next fills.
        The error to raise."""
        with self._replacing:
            if generation == self._generation:
                logger.error("%s: the constraints it held fail, a new one starts", why)
                self._process.kill()
                self._process.join(10)
                with self._lock:
                    for key in spare:
                        self._held.pop(key, None)
                    for constraint in self._held.values():
                        constraint.fail(why)  # type: ignore[attr-defined]
                    self._ids.clear()
                    self._held.clear()
                    self._dropped.clear()
                    try:
                        self._process = _spawn(self.spec)
                        self._hints = self._connect()
                        self._generation += 1
                    except (RuntimeError, OSError):  # tried again at the next failure
                        logger.exception("the mask fill process could not be replaced")
        return RuntimeError(why)

    def _connect(self) -> Connection:
        return Client(self.spec.address, family="AF_UNIX")


class _Gone(RuntimeError):
    """The fill process is gone, or silent past its answer timeout."""


@dataclasses.dataclass(frozen=True)
class _Link:
    """A thread's connection to the fill process of `generation` (a replaced process's are stale)."""

    conn: Connection
    generation: int


def _spawn(spec: FillSpec) -> multiprocessing.Process:
    """A fill process for `spec`, started and listening."""
    context = multiprocessing.get_context("spawn")
    ready, child_ready = context.Pipe(duplex=False)
    process = context.Process(target=serve, args=(spec, child_ready), name="mask-fill", daemon=True)
    process.start()
    child_ready.close()  # the child's end: its death reads as end of file here
    try:
        started = ready.poll(600) and ready.recv() == "ready"
    except EOFError:
        started = False
    if not started:
        process.kill()
        raise RuntimeError("the mask fill process did not start")
    return process


class SentFill:
    """A fill `send_fill` sent: `result()` takes its answer (once) and returns the masks' host view,
    as the future of a fill on a thread would; `exception()` the error instead. Any thread may ask,
    several at once (the fill's thread opening the gate and the engine thread, on a step whose draw
    did not wait for it): the first reads the answer, the others wait for it."""

    def __init__(self, processor: RemoteMaskPostProcessor, rows: Sequence[ConstrainedRow],
                 link: Optional[_Link], error: Optional[BaseException], sent: float = 0.0) -> None:
        self._processor, self._rows, self._link, self._error = processor, rows, link, error
        self._sent = sent
        # Held while the answer is read: a second reader of the connection would wait for an answer
        # that never comes (the server stalled), and a caller passing a reader early got no answer.
        self._taking = threading.Lock()

    def result(self) -> torch.Tensor:
        with self._taking:
            if self._link is not None:
                link, self._link = self._link, None
                try:
                    outcome = self._processor._receive(link, self._processor.phases, self._sent)
                    self._processor._apply(self._rows, outcome)
                    self._processor._mark_closing(self._rows, 0)  # for `upload`, as `fill` marks its rows
                    metrics.mask_fill_time.observe(outcome[2])  # the fill process's own time
                except _Gone as gone:
                    self._error = self._processor._replaced(link.generation, str(gone))
                except RuntimeError as e:
                    self._error = e
                self._processor.phases.mark("remote")
        if self._error is not None:
            raise self._error
        return self._processor._host_views[len(self._rows)]

    def exception(self) -> Optional[BaseException]:
        try:
            self.result()
        except RuntimeError as e:
            return e
        return None


class FillServer:
    """The fill process's side: the constraints by id, filled into the shared buffer."""

    def __init__(self, spec: FillSpec) -> None:
        from llgtrt_core.tokenizer import Tokenizer  # transformers: here, not at the engine process's import

        ll_tokenizer = build_ll_tokenizer(Tokenizer(spec.model_dir).hf, spec.vocab_size, list(spec.eos_token_ids))
        self.compiler = GrammarCompiler.from_config(ll_tokenizer, dataclasses.replace(spec.llguidance, slow_mask_ms=None))
        self._shared = SharedMemory(spec.shared_name)  # the engine process's, which unlinks it
        self.processor = MaskPostProcessor(ll_tokenizer, spec.capacity, spec.llguidance.mask_threads,
                                           host_masks=shared_masks(self._shared, spec.capacity, ll_tokenizer.vocab_size))
        self.constraints: dict[int, GrammarConstraint] = {}

    def handle(self, message: tuple) -> object:
        kind = message[0]
        start = time.perf_counter()
        if kind == "fill":
            _, offset, (dropped, wire) = message
            rows = self._rows(dropped, wire)
            self.processor.fill(rows, offset)
            return _outcome(rows, start)
        _, (dropped, wire) = message  # "apart"
        rows = self._rows(dropped, wire)
        masks = self.processor.fill_apart(rows)
        return masks.numpy().tobytes(), _outcome(rows, start)

    def _rows(self, dropped: list[int], wire: list[WireRow]) -> list[ConstrainedRow]:
        for remote in dropped:
            self.constraints.pop(remote, None)
        rows = []
        for j, (remote, token, new) in enumerate(wire):
            if new is not None:
                self.constraints[remote] = self._constraint(*new)
            rows.append(ConstrainedRow(self.constraints[remote], j, token))
        return rows

    def _constraint(self, grammar: str, guard: Optional[LoopGuardSettings],
                    start: Optional[tuple[int, frozenset[int]]], error: Optional[str]) -> GrammarConstraint:
        """A request's constraint as the engine process built it: compiled, its start committed."""
        compiled = GrammarCompiler.checked(self.compiler.compile_future(grammar).result(), "")
        constraint = self.compiler.new_constraint(compiled, loop_guard=guard)
        if start is not None:
            self.processor.commit_with_forced(constraint, None, *start)
        if error is not None:
            constraint.fail(error)
        return constraint


def _outcome(rows: list[ConstrainedRow], start: float) -> Outcome:
    errors = {j: row.constraint.error for j, row in enumerate(rows) if row.constraint.error is not None}
    closing = [j for j, row in enumerate(rows) if row.constraint.closing]  # type: ignore[attr-defined]
    return errors, closing, time.perf_counter() - start  # type: ignore[return-value]


def _exit_with(parent: int) -> None:
    """End this process once the engine process is gone (killed, it could not stop it)."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)


def serve(spec: FillSpec, ready: Connection) -> None:
    """The fill process: a thread per connection of the engine process (its fill thread, its apart
    threads, the compile hints)."""
    import sys

    from llgtrt_core.engine.torch_engine import GIL_SWITCH_INTERVAL_CUDA_S
    from llgtrt_core.heap import collect_young_less_often, freeze_loaded_objects

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_CUDA_S)  # its threads take turns as the engine process's do
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    server = FillServer(spec)
    if os.path.exists(spec.address):
        os.unlink(spec.address)
    listener = Listener(spec.address, family="AF_UNIX")
    freeze_loaded_objects()
    collect_young_less_often()
    ready.send("ready")

    def connection(conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            received = time.perf_counter()
            if message[0] == "compile":
                server.compiler.compile_future(message[1])
                continue
            try:
                answer = ("ok", server.handle(message))
            except Exception as e:  # the engine process fails the step's rows with it
                logger.exception("mask fill failed")
                answer = ("error", f"{type(e).__name__}: {e}")
            conn.send((*answer, received, time.perf_counter()))

    while True:
        conn = listener.accept()
        threading.Thread(target=connection, args=(conn,), name="mask-fill-conn", daemon=True).start()
