"""The embedded engine's constraint stage: every grammar call of a step goes through here.

Per step: `begin` hands the running constrained rows to the post-processor's `fill` on a worker
thread (it commits each row's last sampled token and computes the masks; llguidance drops the
GIL) while the forward pass runs; `masks` joins it and uploads the masks, which the sampler then
applies as it draws. Fast-forward: `forced` commits a sampled token at once and returns the run of
tokens the grammar forces after it, which the engine feeds without sampling.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch

from llgtrt_core.engine.interface import ConstrainedRow, FastForwarder, StagedPostProcessor
from llgtrt_core.engine.sequence import Sequence
from llgtrt_core.engine.step_profile import StepPhases
from llgtrt_core.engine.sampler import DeviceMasks

logger = logging.getLogger(__name__)


@dataclass
class StepFill:
    rows: list[ConstrainedRow]
    future: Optional[Future]  # the fill on the worker thread; None when no row is constrained

    def error(self) -> Optional[BaseException]:
        """Wait for the fill; the exception it raised, if any."""
        return None if self.future is None else self.future.exception()

    def failed_rows(self) -> set[int]:
        return {row.row for row in self.rows} if self.error() is not None else set()


class ConstraintStage:
    def __init__(self, post_processor: Optional[StagedPostProcessor], fast_forward: bool, device: torch.device):
        self.post_processor = post_processor
        self.forwarder = post_processor if fast_forward and isinstance(post_processor, FastForwarder) else None
        self.device = device
        self._pool: Optional[ThreadPoolExecutor] = None

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

    def begin(self, running: Seq[Sequence]) -> StepFill:
        """Start this step's fill for the constrained running rows (their logits rows are their
        indices); nothing else may commit to their matchers until `masks` is called."""
        rows = [ConstrainedRow(seq.request.constraint, index, seq.uncommitted_token)
                for index, seq in enumerate(running) if seq.request.constraint is not None]
        future = self._pool.submit(self.post_processor.fill, rows) if rows and self._pool is not None else None
        return StepFill(rows, future)

    def masks(self, fill: StepFill, running: Seq[Sequence], stream: Optional[torch.cuda.Stream]
              ) -> Optional[DeviceMasks]:
        """The step's masks on the device, for the sampler to apply; None when no row is constrained
        or the fill failed (its rows then end with an error, the others go on unmasked)."""
        for row in fill.rows:
            running[row.row].uncommitted_token = None
        error = fill.error()
        if error is not None:
            logger.error("mask fill failed", exc_info=error)
            return None
        if fill.future is None:
            return None
        return self.post_processor.upload(fill.rows, fill.future.result(), self.device, stream)
