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
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq

import torch

from llgtrt_core.engine.interface import ConstrainedRow, FastForwarder, StagedPostProcessor
from llgtrt_core.engine.sequence import Sequence
from llgtrt_core.engine.step_profile import StepPhases
from llgtrt_core.engine.sampler import DeviceMasks

logger = logging.getLogger(__name__)


@dataclass
class StepFill:
    rows: list[Optional[ConstrainedRow]]  # buffer row j's logits row now; None: its sequence left
    futures: list[Future]  # the fills on the worker thread, in buffer order; none when no row is constrained
    num_ahead: int = 0  # the first rows, filled by the fill begun ahead (it committed their tokens)

    def error(self) -> Optional[BaseException]:
        """Wait for the fills; the first exception one raised, if any."""
        errors = [future.exception() for future in self.futures]
        return next((e for e in errors if e is not None), None)

    def failed_rows(self) -> set[int]:
        return {row.row for row in self.rows if row is not None} if self.error() is not None else set()


class ConstraintStage:
    def __init__(self, post_processor: Optional[StagedPostProcessor], fast_forward: bool, device: torch.device):
        self.post_processor = post_processor
        self.forwarder = post_processor if fast_forward and isinstance(post_processor, FastForwarder) else None
        self.device = device
        self._pool: Optional[ThreadPoolExecutor] = None
        self._ahead: Optional[tuple[list[ConstrainedRow], Future]] = None  # the next step's fill, begun early

    def start(self) -> None:
        if self.post_processor is not None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

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
        sampled token, waiting for the draw) and commits them; whether it started. Not when a row
        fast-forwards: its commits happen on the engine thread as its tokens are handed out."""
        if self._pool is None or any(seq.fast_forward for seq in running):
            return False
        rows = [ConstrainedRow(seq.request.constraint, index, None)
                for index, seq in enumerate(running) if seq.request.constraint is not None]
        if rows:
            self._ahead = (rows, self._pool.submit(self._fill_ahead, rows, read_tokens))
        return True

    def _fill_ahead(self, rows: list[ConstrainedRow], read_tokens: Callable[[], Seq[int]]) -> torch.Tensor:
        tokens = read_tokens()
        return self.post_processor.fill([ConstrainedRow(row.constraint, row.row, tokens[row.row]) for row in rows])

    def discard_ahead(self) -> None:
        """After a failed step: drop the fill begun ahead, once it is done with the mask buffer, and
        whatever it raised (reading a failed draw), which would otherwise fail the next step's rows."""
        if self._ahead is not None:
            (_, future), self._ahead = self._ahead, None
            future.exception()

    def begin(self, running: Seq[Sequence]) -> StepFill:
        """Start this step's fill for the constrained running rows (their logits rows are their
        indices) that a fill begun ahead does not hold; nothing else may commit to their matchers
        until `masks` is called."""
        ahead_rows, futures = [], []
        if self._ahead is not None:
            (ahead_rows, future), self._ahead = self._ahead, None
            futures.append(future)
        index = {id(seq.request.constraint): i for i, seq in enumerate(running) if seq.request.constraint is not None}
        placed: list[Optional[ConstrainedRow]] = []
        for row in ahead_rows:  # mostly still where they were: the same row (its new_token is None)
            now = index.pop(id(row.constraint), None)
            placed.append(row if now == row.row else None if now is None else ConstrainedRow(row.constraint, now, None))
        rows = [ConstrainedRow(running[i].request.constraint, i, running[i].uncommitted_token) for i in index.values()]
        if rows and self._pool is not None:
            futures.append(self._pool.submit(self.post_processor.fill, rows, len(ahead_rows)))
        return StepFill(placed + rows, futures, len(placed))

    def masks(self, fill: StepFill, running: Seq[Sequence], stream: Optional[torch.cuda.Stream]
              ) -> Optional[DeviceMasks]:
        """The step's masks on the device, for the sampler to apply; None when no row is constrained
        or the fill failed (its rows then end with an error, the others go on unmasked)."""
        for row in fill.rows[fill.num_ahead:]:  # the fill begun ahead committed its rows' tokens itself
            running[row.row].uncommitted_token = None
        error = fill.error()
        if error is not None:
            logger.error("mask fill failed", exc_info=error)
            return None
        if not fill.futures:
            return None
        rows, host = _drop_left(fill.rows, fill.futures[-1].result())
        return self.post_processor.upload(rows, host, self.device, stream) if rows else None


def _drop_left(rows: list[Optional[ConstrainedRow]], host: torch.Tensor) -> tuple[list[ConstrainedRow], torch.Tensor]:
    """The rows still running and their masks, the rows of those that left filled from the end
    (a few a step), as the scheduler fills a finished sequence's cache row."""
    live = [row for row in rows if row is not None]
    if len(live) == len(rows):
        return live, host
    kept = list(rows[:len(live)])
    tail = (j for j in range(len(live), len(rows)) if rows[j] is not None)
    for hole in (j for j, row in enumerate(kept) if row is None):
        source = next(tail)
        host[hole] = host[source]
        kept[hole] = rows[source]
    return kept, host[:len(live)]  # type: ignore[return-value]
