"""The embedded engine's constraint stage: every grammar call of a step goes through here.

Per step: `begin` hands the running constrained rows to the post-processor's `fill` on a worker
thread (it commits each row's last sampled token and computes the masks; llguidance drops the
GIL) while the forward pass runs; `masks` joins it and uploads the masks, which the sampler then
applies as it draws. Fast-forward: `forced` commits a sampled token at once and returns the run of
tokens the grammar forces after it, which the engine feeds without sampling.

On CUDA (overlapped steps) `begin_ahead` starts the next step's fill as soon as a step's draw
is queued: the fill's thread waits for the sampled tokens to reach the host, commits them and
computes the masks while the engine thread queues the next decode, hands the tokens out and
schedules (at batch 256 the fill takes ~5-8 ms, a decode ~9 ms, and started only once the host
had read the tokens it was the step's critical path). The rows move meanwhile (finished ones
leave, aborts, new prompts join), so the next `begin` matches the early masks to its rows by
constraint, fills the rows that joined after them and `masks` drops those of rows that left.

A slow grammar's rows (probed at compile: `MaskPostProcessor.split_apart`) are filled apart, one
job per step on a pool of their own, so the batch's fill returns without them (a step waited for
its slowest row: 3-10 ms for a string `pattern` with `maxLength`). When such a row's mask is not
ready at its draw, `masks` says it sits the step out (the engine drops its draw and decodes its
previous token again); its mask stays on the way and serves the next step.

On CUDA the engine thread does not wait for the fill (where the driver lets a stream wait on host
memory, `HostGate`): `masks` queues the masks' copy behind a wait on the device, which the fill's
thread lets go once the step's fills are done. The engine thread queues the draw and the next
decode meanwhile, as in a step without constraints, so its own work (handing out tokens,
scheduling) is off the step's path; the fill alone is on it.
"""

from __future__ import annotations

import functools
import logging
import operator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

import torch

from llgtrt_core.engine.interface import (ApartFiller, ConstrainedRow, Constraint, FastForwarder,
                                         StagedPostProcessor)
from llgtrt_core.engine.sequence import Sequence
from llgtrt_core.engine.step_profile import StepPhases
from llgtrt_core.engine.sampler import DeviceMasks
from llgtrt_core.kernels import cuda_kernel_available
from llgtrt_core.kernels.host_gate import GateTicket, HostGate
from llgtrt_core.os_threads import name_os_thread

logger = logging.getLogger(__name__)

_CONSTRAINT, _ROW = operator.itemgetter(0), operator.itemgetter(1)  # a ConstrainedRow's fields, for map()
_SEQUENCE_CONSTRAINT = operator.attrgetter("request.constraint")
_NEW_ROW = functools.partial(tuple.__new__, ConstrainedRow)  # a ConstrainedRow from a tuple, in C


@dataclass
class _Layout:
    """The running rows as `begin_ahead` last saw them."""

    constraints: list[Optional[Constraint]]  # row i's constraint (held: no other object takes their ids)
    rows: list[ConstrainedRow]  # the constrained rows, no token
    fast_forward: bool  # some row fast-forwards


@dataclass
class StepFill:
    rows: list[Optional[ConstrainedRow]]  # buffer row j's logits row now; None: its sequence left
    futures: list[Future]  # the fills on the worker thread, in buffer order; none when no row is constrained
    num_ahead: int = 0  # the first rows, filled by the fill begun ahead (it committed their tokens)
    apart: list[ConstrainedRow] = field(default_factory=list)  # rows whose mask is filled apart (slow grammars)

    def wait(self) -> None:
        """Wait for the fills, failed or not (`failures` says which rows failed)."""
        for future in self.futures:
            future.exception()

    def failures(self) -> dict[int, BaseException]:
        """Wait for the fills; each logits row of a fill that failed, with its exception. Only that
        fill's rows: a fill begun ahead for rows that have all left may fail (its process gone)
        while the rows that joined are filled elsewhere."""
        failed: dict[int, BaseException] = {}
        for k, future in enumerate(self.futures):
            error = future.exception()
            if error is not None:
                failed.update((row.row, error) for row in self._filled_by(k) if row is not None)
        return failed

    def _filled_by(self, k: int) -> list[Optional[ConstrainedRow]]:
        """futures[k]'s rows: a fill begun ahead holds the first num_ahead (it comes first), the step's own the rest."""
        return self.rows[:self.num_ahead] if k == 0 and self.num_ahead else self.rows[self.num_ahead:]


class ConstraintStage:
    def __init__(self, post_processor: Optional[StagedPostProcessor], fast_forward: bool, device: torch.device):
        self.post_processor = post_processor
        self.forwarder = post_processor if fast_forward and isinstance(post_processor, FastForwarder) else None
        self.device = device
        self._pool: Optional[ThreadPoolExecutor] = None
        # The next step's fill, begun early: a future, or what `send_fill` returned (None until `tokens_read`).
        self._ahead: Optional[tuple[list[ConstrainedRow], Optional[Future]]] = None
        self._layout: Optional[_Layout] = None  # the rows the fill begun ahead was for
        # Rows filled apart: by constraint, the job computing its next mask and its row in the job's
        # masks, from its start until a draw takes the mask. Only the job touches that matcher meanwhile.
        self._apart: dict[int, tuple[Future, int]] = {}
        self._apart_pool: Optional[ThreadPoolExecutor] = None
        self._gate: Optional[HostGate] = None  # on CUDA: the device, not the engine thread, waits for the fill

    def start(self, device_waits: bool = True) -> None:
        """device_waits: on CUDA, where the driver can, the draw's masks are waited for on the device."""
        if self.post_processor is not None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mask-fill", initializer=name_os_thread,
                                            initargs=("mask-fill",))
            if device_waits and self.device.type == "cuda" and cuda_kernel_available():
                self._gate = HostGate.create(self.device)
        if isinstance(self.post_processor, ApartFiller):
            # Two: a row that sat out may still be filling when the others' next job starts.
            self._apart_pool = ThreadPoolExecutor(2, thread_name_prefix="mask-fill-apart", initializer=name_os_thread,
                                                  initargs=("mask-fill-apart",))

    def shutdown(self) -> None:
        for pool in (self._pool, self._apart_pool):
            if pool is not None:
                pool.shutdown()
        self._pool = self._apart_pool = self._gate = None
        self._apart.clear()
        self._layout = None

    @property
    def forwards_each_token(self) -> bool:
        """Whether a sequence may fast-forward past its start (the post-processor commits any token at
        once; the fill process commits every sampled token in a fill)."""
        return self.forwarder is not None and self.forwarder.forwards_each_token

    @property
    def device_waits(self) -> bool:
        """Whether a step's draw waits for its masks on the device (`masks`), not on the engine thread."""
        return self._gate is not None

    def phases(self) -> Optional[StepPhases]:
        """The post-processor's fill phases, when it keeps them."""
        return getattr(self.post_processor, "phases", None)

    def forced(self, seq: Sequence, token: Optional[int], limit: int) -> list[int]:
        """Commit `token` (None: nothing sampled yet) and return the up to `limit` tokens its grammar
        forces next, committed too: empty unless the sequence fast-forwards. A forced stop token is
        left to the sampler (the mask allows only it), so the request ends with "stop" as usual."""
        if not seq.fast_forward:  # set only where there is a forwarder
            return []
        return self.forwarder.commit_with_forced(seq.request.constraint, token, limit,
                                                 seq.request.sampling.stop_token_ids)

    def begin_ahead(self, running: Seq[Sequence], read_tokens: Callable[[], Seq[int]]) -> bool:
        """Start the next step's fill on the fill's thread, which first calls `read_tokens()` (row i's
        sampled token, waiting for the draw) and commits them, and the rows filled apart in a job of
        their own; whether it started. Not when a row fast-forwards: its commits happen on the engine
        thread as its tokens are handed out. A row sitting out keeps the mask on its way."""
        if self._pool is None:
            return False
        layout = self._layout_of(running)
        if layout.fast_forward:
            return False
        rows = layout.rows
        if self._apart:  # sitting out: its mask is on the way
            rows = [row for row in rows if id(row.constraint) not in self._apart]
        apart, rows = self._split_apart(rows)
        if rows:
            # A post-processor that sends its fills away is handed the tokens by the engine thread
            # (`tokens_read`); otherwise the fill's thread waits for them.
            sends = hasattr(self.post_processor, "send_fill")
            self._ahead = (rows, None if sends else self._pool.submit(self._fill_ahead, rows, read_tokens))
        if apart:
            self._start_apart(apart, read_tokens)
        return True

    def _layout_of(self, running: Seq[Sequence]) -> _Layout:
        """The running rows' constraints, their rows and whether any fast-forwards. On most steps
        every row holds the constraint it held at the last call, whose rows then serve again:
        building a row per sequence took ~0.2 ms of the engine thread's step at batch 256."""
        constraints = list(map(_SEQUENCE_CONSTRAINT, running))
        layout = self._layout
        if layout is None or not _same(layout.constraints, constraints):
            rows = [ConstrainedRow(c, index, None) for index, c in enumerate(constraints) if c is not None]
            layout = self._layout = _Layout(constraints, rows, any([seq.fast_forward for seq in running]))
        return layout

    def tokens_read(self, tokens: Seq[int]) -> None:
        """The engine thread read the draw the fill begun ahead waits for (row i's token tokens[i]):
        a post-processor that sends its fills away gets it now."""
        if self._ahead is not None and self._ahead[1] is None:
            rows = self._ahead[0]
            self._ahead = (rows, self.post_processor.send_fill(_with_tokens(rows, tokens)))

    def _fill_ahead(self, rows: list[ConstrainedRow], read_tokens: Callable[[], Seq[int]]) -> torch.Tensor:
        return self.post_processor.fill(_with_tokens(rows, read_tokens()))

    def _split_apart(self, rows: list[ConstrainedRow]) -> tuple[list[ConstrainedRow], list[ConstrainedRow]]:
        """`rows` (none of which fast-forwards: such a row's commits are the engine thread's) as
        (those filled apart: slow grammars', the rest)."""
        if self._apart_pool is None or not rows:
            return [], rows
        return self.post_processor.split_apart(rows)

    def _start_apart(self, rows: list[ConstrainedRow], read_tokens: Optional[Callable[[], Seq[int]]]) -> None:
        """One job for these rows, which first reads their sampled tokens (read_tokens None: the
        rows carry them)."""
        job = self._apart_pool.submit(self._fill_apart, rows, read_tokens)
        for j, row in enumerate(rows):
            self._apart[id(row.constraint)] = (job, j)

    def _fill_apart(self, rows: list[ConstrainedRow], read_tokens: Optional[Callable[[], Seq[int]]]) -> torch.Tensor:
        return self.post_processor.fill_apart(rows if read_tokens is None else _with_tokens(rows, read_tokens()))

    def discard_ahead(self) -> None:
        """After a failed step: drop the fill begun ahead, once it is done with the mask buffer, and
        whatever it raised (reading a failed draw), which would otherwise fail the next step's rows."""
        if self._ahead is not None:
            (_, future), self._ahead = self._ahead, None
            if future is not None:  # None: its tokens were never read, nothing was sent
                future.exception()
        self._apart.clear()  # their sequences are gone; each job ends on its own

    def begin(self, running: Seq[Sequence]) -> StepFill:
        """Start this step's fill for the constrained running rows (their logits rows are their
        indices) that a fill begun ahead does not hold; nothing else may commit to their matchers
        until `masks` is called."""
        ahead_rows, futures = [], []
        if self._ahead is not None:
            (ahead_rows, future), self._ahead = self._ahead, None
            futures.append(future)
        constraints = list(map(_SEQUENCE_CONSTRAINT, running))
        placed: list[Optional[ConstrainedRow]] = []
        index: Optional[dict[int, int]] = None  # constraint -> its row now, once a row is found moved
        if self._layout is not None and _same(self._layout.constraints, constraints):
            placed = list(ahead_rows)  # every sequence holds the row begin_ahead saw it in (most steps)
        else:
            for row in ahead_rows:  # mostly still where they were: the same row (its new_token is None)
                if row.row < len(constraints) and constraints[row.row] is row.constraint:
                    placed.append(row)
                    continue
                index = index or _rows_by_constraint(constraints)
                now = index.get(id(row.constraint))
                placed.append(None if now is None else ConstrainedRow(row.constraint, now, None))
        rows, apart, new_apart = [], [], []
        held = len(placed) - placed.count(None)
        if self._apart:  # filled apart, their masks on the way (never in the fill begun ahead): a few rows
            index = index or _rows_by_constraint(constraints)
            apart = sorted((ConstrainedRow(constraints[i], i, running[i].uncommitted_token)
                            for i in map(index.get, self._apart) if i is not None), key=_ROW)
            self._forget_apart(index)
        if held + len(apart) < len(constraints) - constraints.count(None):  # rows that joined since
            held_ids = set(map(id, map(_CONSTRAINT, filter(None, placed)))).union(self._apart)
            rows = [ConstrainedRow(c, i, running[i].uncommitted_token) for i, c in enumerate(constraints)
                    if c is not None and id(c) not in held_ids]
            new_apart, _ = self._split_apart([row for row in rows if not running[row.row].fast_forward])
            if new_apart:
                moved = {row.row for row in new_apart}
                rows = [row for row in rows if row.row not in moved]
                for row in new_apart:
                    running[row.row].uncommitted_token = None  # the job commits it
                self._start_apart(new_apart, None)
        if rows and self._pool is not None:
            futures.append(self._pool.submit(self.post_processor.fill, rows, len(ahead_rows)))
        return StepFill(placed + rows, futures, len(placed), apart + new_apart)

    def _forget_apart(self, running: dict[int, int]) -> None:
        """Drop the finished jobs' masks of sequences no longer running (`running`: the running rows'
        constraints by id; a job still running keeps its entry: its matcher may run again, as a
        preempted sequence comes back)."""
        for key in [key for key, (job, _) in self._apart.items() if key not in running and job.done()]:
            del self._apart[key]

    def masks(self, fill: StepFill, running: Seq[Sequence], stream: Optional[torch.cuda.Stream],
              may_sit_out: Callable[[int], bool] = lambda row: False) -> tuple[Optional[DeviceMasks], list[int]]:
        """The step's masks on the device, for the sampler to apply (None when no row is constrained
        or the fill failed: its rows then end with an error, the others go on unmasked), and the rows
        that sit this step out: filled apart, their mask not ready, and `may_sit_out` (their draw can
        be made again alike). Unless every row would: then the step waits for them.
        With a gate (`device_waits`), the fill is not waited for here: its masks' copy waits on the
        device until the fill's thread, done with the step's fills, opens the gate; a failed fill's
        rows are drawn under whatever masks it left, and end with the error all the same."""
        for row in fill.rows[fill.num_ahead:]:  # the fill begun ahead committed its rows' tokens itself
            running[row.row].uncommitted_token = None
        rows: list[Optional[ConstrainedRow]] = []
        host: Optional[torch.Tensor] = None
        gate: Optional[GateTicket] = None
        if fill.futures and self._gate is not None and len(fill.rows) + len(fill.apart) <= self.post_processor.capacity:
            # Opened by the fill's thread after the step's fills (queued before it, or sent away:
            # their answers taken there); queued before any wait for it, so a step that fails from
            # here on leaves no stream waiting for good.
            gate = GateTicket(self._gate, self._gate.ticket())
            self._pool.submit(self._open_after, fill, gate.ticket)
            rows, host = list(fill.rows), self.post_processor.host_masks(len(fill.rows))
        elif fill.futures:
            failed = fill.failures()
            if failed:
                logger.error("mask fill failed", exc_info=next(iter(failed.values())))
            # A failed fill's rows are skipped (they end with the error); the others' masks stand.
            rows = [None if row is None or row.row in failed else row for row in fill.rows]
            host = self.post_processor.host_masks(len(fill.rows))
        sitting_out = [row.row for row in fill.apart
                       if not self._apart[id(row.constraint)][0].done() and may_sit_out(row.row)]
        if len(sitting_out) == len(running):
            sitting_out = []
        taken = [row for row in fill.apart if row.row not in sitting_out]
        if taken:
            host = self.post_processor.extend(host, taken, [self._take_apart(row.constraint) for row in taken])
            rows += taken
        if not any(rows):  # none constrained, or all left
            return None, sitting_out
        return self.post_processor.upload(rows, host, self.device, stream, gate), sitting_out

    def _open_after(self, fill: StepFill, ticket: int) -> None:
        """On the fill's thread: once the step's fills are done, let the copy of their masks go."""
        try:
            fill.wait()
        finally:
            self._gate.open(ticket)

    def _take_apart(self, constraint: Constraint) -> torch.Tensor:
        """The row's mask filled apart, waited for: its job's row (1, words)."""
        job, j = self._apart.pop(id(constraint))
        return job.result()[j:j + 1]


def _rows_by_constraint(constraints: list[Optional[Constraint]]) -> dict[int, int]:
    """Each running row's index by its constraint's id (a C-level pass: the engine thread's)."""
    return dict(zip(map(id, constraints), range(len(constraints))))


def _same(a: list[Optional[Constraint]], b: list[Optional[Constraint]]) -> bool:
    """Row for row the same constraints (identity, a C-level pass)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _with_tokens(rows: list[ConstrainedRow], tokens: Seq[int]) -> list[ConstrainedRow]:
    """The rows, each with its sampled token (row i's is tokens[i]) to commit, built in C-level
    passes: the fill's thread holds the GIL meanwhile, which the engine thread may wait for."""
    indices = list(map(_ROW, rows))
    return list(map(_NEW_ROW, zip(map(_CONSTRAINT, rows), indices, map(tokens.__getitem__, indices))))
