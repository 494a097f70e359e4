"""The batched logits post-processor: one call per engine step for every constrained row.

Per step: commit each row's newest token to its matcher, compute every mask in parallel
without the GIL (llguidance's rayon executor; the loop guards observe the tokens on a thread
beside meanwhile) into one preallocated int32 buffer (pinned when CUDA is present), copy it to
the device once, asynchronously, and mask the logits there with `llgtrt_core.kernels`. `fill`
and `apply` are separate so an engine can fill the masks while its forward pass runs and apply
them once the logits exist (the TensorRT-LLM adapter does); `apply` is `upload` then the kernel,
and an engine that masks while it samples (the PyTorch engine's fused sampling) takes the
uploaded masks from `upload` alone.
An engine that can append several tokens in one forward pass (the PyTorch engine) instead
commits each sampled token through `commit_with_forced`, which also returns the tokens the
grammar forces next, committed too, for it to feed without sampling.
Rows whose grammar is slow (probed at compile, `MaskCost`) can be filled apart (`fill_apart`, on
another thread and a small pool of their own), so the batch's fill does not wait for them; the
engine then takes their masks, when ready, into the step's buffer (`extend`).
The loop guards (constraints/loop_guard.py) steer a looping row's host mask in the fill; the
masks of rows near their length limit are narrowed to the nearest ending in `upload`, on the GPU
when the masks go there.

A row whose token is rejected, or whose matcher fails (e.g. a parser limit mid-generation),
gets its constraint's `error` set and a mask allowing EOS only; the engine ends that request
with the error and the other rows go on. A matcher whose grammar is complete also allows EOS
only, so the sequence ends with the model's EOS (finish_reason "stop").
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch
from llguidance import LLExecutor, LLTokenizer
from llguidance.torch import allocate_token_bitmask

from llgtrt_core import metrics
from llgtrt_core.constraints.grammar import GrammarConstraint, MaskCost
from llgtrt_core.constraints.loop_guard import EscapeMasks, Steering, closing_positions, loop_steering, steer_loops
from llgtrt_core.engine.interface import ConstrainedRow, Constraint
from llgtrt_core.engine.step_profile import StepPhases
from llgtrt_core.kernels import apply_token_bitmask_inplace, cuda_kernel_available, narrow_to_endings
from llgtrt_core.kernels.host_gate import GateTicket
from llgtrt_core.os_threads import name_os_thread, os_thread_named

logger = logging.getLogger(__name__)

_NEVER_SLOW = MaskCost()  # the cost of a constraint that has none
APART_THREADS = 2  # llguidance's pool for the rows filled apart (slow grammars: a few rows at a time)


class MaskPostProcessor:
    """Implements `LogitsPostProcessor` and `FastForwarder` for rows whose constraint is a `GrammarConstraint`."""

    forwards_each_token = True  # `FastForwarder`: commits any sampled token at once

    def __init__(self, ll_tokenizer: LLTokenizer, max_batch_size: int = 64, num_threads: Optional[int] = None,
                 host_masks: Optional[torch.Tensor] = None):
        """host_masks: a (rows, words) int32 buffer to fill, never replaced (shared with the fill
        process, constraints/fill_process.py); default: one allocated here, grown as needed."""
        self.vocab_size = ll_tokenizer.vocab_size
        self.pool = MaskPool(num_threads, "llg-masks")  # llguidance's default: 80% of the cores, up to 32
        # The rows filled apart get a pool of their own: a thread of the batch's pool that waits for
        # a stolen job may pick up a slow row's meanwhile, and the batch's fill would wait for it.
        self._apart_pool: Optional[MaskPool] = None
        self.pin_memory = torch.cuda.is_available()
        self._fixed_host = host_masks is not None
        self._allocate_host(max_batch_size, host_masks)
        self._device: Optional[DeviceCopies] = None
        self._copy_done: Optional[torch.cuda.Event] = None  # the last copy out of the host buffers
        self._eos_only = eos_only_mask(ll_tokenizer.eos_tokens, self._host_masks.shape[1])
        self.phases = StepPhases()  # of `fill`, on whichever thread runs it
        self._escapes = EscapeMasks.for_tokenizer(ll_tokenizer, self._host_masks.shape[1])

    def __call__(
        self,
        rows: Sequence[ConstrainedRow],
        logits: torch.Tensor,
        stream: Optional[torch.cuda.Stream] = None,
    ) -> None:
        if rows:
            self.apply(rows, logits, self.fill(rows), stream)

    def fill(self, rows: Sequence[ConstrainedRow], offset: int = 0) -> torch.Tensor:
        """Commit each row's new token, then compute the masks: a host (offset + len(rows), words)
        int32 view of the shared buffer whose row offset + j is rows[j]'s mask (the rows before
        `offset` are an earlier fill's of the same step, kept). Valid until the next `fill` at
        offset 0."""
        count = len(rows)
        self._reserve(offset + count, keep=offset)
        start = time.perf_counter()
        self.phases.begin()
        self._fill_rows(rows, self._host_masks[offset:], self.pool, self.phases)
        self._mark_closing(rows, offset)
        metrics.mask_fill_time.observe(time.perf_counter() - start)
        return self.host_masks(offset + count)

    @property
    def capacity(self) -> int:
        """Rows the shared buffer holds before a `fill` or `extend` replaces it."""
        return self._capacity

    def host_masks(self, count: int) -> torch.Tensor:
        """The shared buffer's first `count` rows, as `fill` returns them (a fill still running writes them)."""
        return self._host_views[count]

    def split_apart(self, rows: list[ConstrainedRow]) -> tuple[list[ConstrainedRow], list[ConstrainedRow]]:
        """`rows` as (those better filled apart from the batch's: their grammar's masks are slow, the
        rest). One pass and no call a row: the engine thread asks every step."""
        if not MaskCost.any_slow:  # until a grammar is marked slow, no row is asked
            return [], rows
        # A GrammarConstraint's cost; anything else counts as fast, is batched (and fails there).
        slow = [getattr(row.constraint, "mask_cost", _NEVER_SLOW).slow for row in rows]
        if not any(slow):
            return [], rows
        return [row for row, apart in zip(rows, slow) if apart], [row for row, apart in zip(rows, slow) if not apart]

    def fill_apart(self, rows: Sequence[ConstrainedRow]) -> torch.Tensor:
        """`fill` for rows filled apart from the batch's (slow grammars), on another thread meanwhile: the
        same commits, masks and loop steering, into a (len(rows), words) host buffer of their own. A
        row that fails gets its constraint's error and the EOS-only mask; nothing raises."""
        host = torch.empty(len(rows), self._host_masks.shape[1], dtype=torch.int32)
        if self._apart_pool is None:
            self._apart_pool = MaskPool(APART_THREADS, "llg-masks-apart")
        try:
            self._fill_rows(rows, host, self._apart_pool)
        except Exception as e:
            logger.exception("mask fill apart failed")
            return self._failed_apart(rows, e)
        return host

    def _failed_apart(self, rows: Sequence[ConstrainedRow], error: Exception) -> torch.Tensor:
        """`fill_apart`'s answer when it failed: each row fails with `error`, its mask EOS only."""
        for row in rows:
            row.constraint.fail(f"mask fill failed: {error}")  # type: ignore[attr-defined]
        return self._eos_only.repeat(len(rows), 1)

    def extend(self, masks: Optional[torch.Tensor], rows: Sequence[ConstrainedRow],
               more: Sequence[torch.Tensor]) -> torch.Tensor:
        """The step's masks for `upload`: `masks` (what `fill` returned this step, or `host_masks`
        while it runs; None: it filled none), then `rows`' masks, in order the rows of `more`
        (`fill_apart`'s), in the shared buffer. The rows past `masks`' only: a fill may be writing those."""
        start = 0 if masks is None else masks.shape[0]
        count = start + sum(part.shape[0] for part in more)
        self._reserve(count, keep=start)
        self._mark_closing(rows, start)
        for part in more:
            self._host_masks[start:start + part.shape[0]] = part
            start += part.shape[0]
        return self._host_views[count]

    def apply(
        self,
        rows: Sequence[ConstrainedRow],
        logits: torch.Tensor,
        masks: torch.Tensor,
        stream: Optional[torch.cuda.Stream] = None,
    ) -> None:
        """Mask `logits` rows in place with the masks `fill` returned, on `stream` when on CUDA."""
        if not logits.is_cuda and len(rows) == logits.shape[0] and all(row.row == j for j, row in enumerate(rows)):
            masks, _ = self.upload(rows, masks, logits.device)  # on CPU: the host buffer, its closing rows narrowed
            apply_token_bitmask_inplace(logits, masks)  # the whole batch: no row indirection
            return
        device_masks, device_rows = self.upload(rows, masks, logits.device, stream)
        apply_token_bitmask_inplace(logits, device_masks, device_rows, stream=stream)

    def upload(
        self,
        rows: Sequence[Optional[ConstrainedRow]],
        masks: torch.Tensor,
        device: torch.device,
        stream: Optional[torch.cuda.Stream] = None,
        gate: Optional[GateTicket] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks `fill` returned and their logits row indices, on `device` (-1 for a row given
        as None: it left, its mask is skipped): on CUDA copied asynchronously (`DeviceCopies`), for
        work queued on `stream` (the compute stream) before the next upload; on CPU the host buffers
        themselves, valid until the next `fill` and `upload`. The masks of rows near their length
        limit (`closing`, marked by the fill) are narrowed to the nearest ending here: on CUDA by a
        kernel queued on `stream` after the copy, else in the host buffer.
        gate: on CUDA, the copy waits on the device for it (the fill may still be running now); the
        engine starts the next fill only once this step's draw is read, after the copy."""
        count = len(rows)
        indices = self._host_rows[:count]
        indices.numpy()[:] = [-1 if row is None else row.row for row in rows]  # straight into the (pinned) buffer
        closing = self._host_closing[:count]
        if device.type != "cuda" or not cuda_kernel_available():
            positions = np.flatnonzero(closing.numpy() >= 0)
            if len(positions):
                self._escapes.narrow_to_endings(masks, positions.tolist())
            if device.type != "cuda":
                return masks, indices
            closing = self._host_closing[:0]
        stream = stream or torch.cuda.current_stream(device)
        if self._device is None or self._device.device != device or self._device.capacity < count:
            if self._device is not None:
                torch.cuda.synchronize(self._device.device)  # queued work may still read the old buffers
            self._device = DeviceCopies(device, max(count, self._capacity), self._host_masks.shape[1],
                                        self._escapes.ending_tables())
        device_masks, device_indices, copy_done = self._device.copy(masks, indices, closing, stream, gate)
        if gate is None:  # a gated copy waits for the fill, which must not wait for it (`_reserve`)
            self._copy_done = copy_done
        if len(closing):  # rows not closing hold -1: the kernel skips them
            with torch.cuda.stream(stream):
                narrow_to_endings(device_masks, device_indices[count:], *self._device.ending_tables)
        return device_masks, device_indices[:count]

    def commit_with_forced(self, constraint: Constraint, token: Optional[int], limit: int,
                           stop_token_ids: frozenset[int] = frozenset()) -> list[int]:
        """`FastForwarder`: commit `token` now, then the run of tokens the grammar forces after it
        (llguidance's fast-forward tokens, at most `limit`), which the engine feeds unsampled."""
        grammar: GrammarConstraint = constraint  # type: ignore[assignment]
        if grammar.error is not None or (token is not None and not self._consume_one(grammar, token)):
            return []
        start, grammar.start_forced = grammar.start_forced, None  # known at the matcher's start only
        try:
            forced = list(start if token is None and start is not None else grammar.matcher.compute_ff_tokens())
            forced = forced[:max(limit, 0)]
            forced = forced[:next((i for i, t in enumerate(forced) if t in stop_token_ids), len(forced))]
            if forced and not grammar.matcher.consume_tokens(forced):
                self._reject(grammar, forced[0])
                return []
        except Exception as e:
            grammar.fail(f"forced tokens failed after token {token}: {e}")
            return []
        if grammar.loop_guard is not None:
            grammar.loop_guard.observe_all(forced if token is None else [token, *forced])
        return forced

    def _fill_rows(self, rows: Sequence[ConstrainedRow], host: torch.Tensor, pool: MaskPool,
                   phases: Optional[StepPhases] = None) -> None:
        """Commit and compute `rows`' masks into `host`'s first rows, then steer the looping ones."""
        if len(rows) == 1:  # no thread hand-off for a lone row
            self._fill_one(rows[0], host)
            steering = loop_steering(rows, self._escapes)
            if phases is not None:
                phases.mark("one_row")
        elif rows:
            steering = self._fill_batch(rows, host, pool, phases)
        else:
            return
        steer_loops(rows, host, steering, self._escapes)
        if phases is not None:
            phases.mark("steer")

    def _fill_one(self, row: ConstrainedRow, host: torch.Tensor) -> None:
        """The batch path's steps inlined: this runs once per token of a lone request."""
        constraint: GrammarConstraint = row.constraint  # type: ignore[assignment]
        token = row.new_token
        if constraint.error is None:
            matcher = constraint.matcher
            try:
                if token is None or matcher.consume_token(token):
                    matcher.unsafe_compute_mask_ptr(host.data_ptr(), self._row_bytes)
                else:
                    self._reject(constraint, token)
            except Exception as e:
                constraint.fail(f"grammar step failed at token {token}: {e}")
        self._settle(constraint, host, 0)

    def _fill_batch(self, rows: Sequence[ConstrainedRow], host: torch.Tensor, pool: MaskPool,
                    phases: Optional[StepPhases] = None) -> Steering:
        """Commit all new tokens, then all masks (into `host`'s rows), each on `pool`'s rayon threads
        (no GIL), the loop guards observing the tokens meanwhile (`pool.beside`); their steering."""
        constraints: list[GrammarConstraint] = [row.constraint for row in rows]  # type: ignore[misc]
        pending = [(j, row.new_token) for j, row in enumerate(rows)
                   if row.new_token is not None and constraints[j].error is None]
        if pending:
            try:
                accepted = pool.executor.consume_token_par([(constraints[j].matcher, t) for j, t in pending])
            except Exception:  # API misuse somewhere in the batch: retry row by row
                logger.exception("batched token commit failed; committing row by row")
                accepted = [self._consume_one(constraints[j], t) for j, t in pending]
            if not all(accepted):
                for (j, token), ok in zip(pending, accepted):
                    if not ok:
                        self._reject(constraints[j], token)
        if phases is not None:
            phases.mark("commit")
        # The loop guards' Python (once per row) runs beside while llguidance computes the masks on
        # this thread, which enters llguidance holding the GIL (computed on the other thread, the
        # masks waited for the GIL to start).
        live = [(c.matcher, j) for j, c in enumerate(constraints) if c.error is None]
        guarding = pool.beside.submit(loop_steering, rows, self._escapes)
        try:
            if live:
                pool.executor.unsafe_compute_mask_ptr(live, host.data_ptr(), self._row_bytes, len(rows))
        except Exception:  # one bad row must not cost the others their masks
            logger.exception("batched mask fill failed; filling row by row")
            for _, j in live:
                self._compute_one(constraints[j], host, j)
        if phases is not None:
            phases.mark("masks")
        steering = guarding.result()
        if phases is not None:
            phases.mark("guard")
        for j, constraint in enumerate(constraints):  # _settle, inlined: once per row per step
            if constraint.error is None and not constraint.matcher.is_error():
                continue
            self._settle(constraint, host, j)
        if phases is not None:
            phases.mark("settle")
        return steering

    def _consume_one(self, constraint: GrammarConstraint, token: int) -> bool:
        try:
            ok = constraint.matcher.consume_token(token)
        except Exception as e:
            constraint.fail(f"token {token} could not be committed: {e}")
            return False
        if not ok:
            self._reject(constraint, token)
        return ok

    @staticmethod
    def _reject(constraint: GrammarConstraint, token: int) -> None:
        constraint.fail(constraint.matcher.get_error() or f"token {token} rejected by the grammar")

    def _compute_one(self, constraint: GrammarConstraint, host: torch.Tensor, j: int) -> None:
        """Mask straight into host[j] by pointer (llguidance drops the GIL)."""
        try:
            constraint.matcher.unsafe_compute_mask_ptr(host.data_ptr() + j * self._row_bytes, self._row_bytes)
        except Exception as e:
            constraint.fail(f"mask computation failed: {e}")

    def _settle(self, constraint: GrammarConstraint, host: torch.Tensor, j: int) -> None:
        """A matcher that failed (now or before: a limit hit mid-step) gets the EOS-only mask."""
        if constraint.error is None and constraint.matcher.is_error():
            constraint.fail(constraint.matcher.get_error())
        if constraint.error is not None:
            host[j] = self._eos_only

    def _reserve(self, count: int, keep: int) -> None:
        """Room for `count` rows, the first `keep` kept (an earlier fill's of this step)."""
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's async copy still reads the buffer
            self._copy_done = None
        if count > self._capacity:
            if self._fixed_host:
                raise RuntimeError(f"{count} constrained rows in a step, more than the mask buffer's {self._capacity}")
            kept, kept_closing = self._host_masks[:keep], self._host_closing[:keep]
            self._allocate_host(count)
            self._host_masks[:keep] = kept
            self._host_closing[:keep] = kept_closing

    def _allocate_host(self, capacity: int, host_masks: Optional[torch.Tensor] = None) -> None:
        self._capacity = capacity
        # Pinned when CUDA is present.
        self._host_masks = allocate_token_bitmask(capacity, self.vocab_size) if host_masks is None else host_masks
        self._host_rows = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pin_memory)  # `upload`'s
        # Row j's position where its mask narrows to an ending (`_mark_closing`), else -1.
        self._host_closing = torch.full((capacity,), -1, dtype=torch.int64, pin_memory=self.pin_memory)
        self._closing_flags = self._host_closing.numpy()
        self._row_bytes = self._host_masks.shape[1] * 4
        self._host_views = [self._host_masks[:count] for count in range(capacity + 1)]

    def _mark_closing(self, rows: Sequence[ConstrainedRow], offset: int) -> None:
        """Mark buffer row offset + j for narrowing where rows[j] is near its length limit
        (`closing`, which the fill's loop steering sets), for `upload`."""
        flags = self._closing_flags[offset:offset + len(rows)]
        flags.fill(-1)
        closing = closing_positions(rows)
        if closing:
            flags[closing] = np.asarray(closing) + offset



class MaskPool:
    """llguidance's executor for a fill's rows, and a thread beside the fill's for its Python that
    needs no mask (the loop guards), run while the fill's thread computes the masks without the GIL."""

    def __init__(self, num_threads: Optional[int], name: str) -> None:
        with os_thread_named(name):  # llguidance's threads, started now, keep it
            self.executor = LLExecutor(num_threads)
        self.beside = ThreadPoolExecutor(1, thread_name_prefix="loop-guard", initializer=name_os_thread,
                                         initargs=("loop-guard",))


class DeviceCopies:
    """The device side of `upload`: two mask buffers used in turn, filled on a copy stream of their
    own, so that a step's copy (4 MB at batch 256 with a 128k vocabulary) runs beside the forward
    pass queued before it rather than after it on the compute stream."""

    def __init__(self, device: torch.device, capacity: int, words: int, ending_tables: tuple[np.ndarray, int]) -> None:
        self.device = device
        self.capacity = capacity
        self.stream = torch.cuda.Stream(device)
        tables, string_classes = ending_tables  # the loop guard's, for `narrow_to_endings`
        # On the copy stream, pinned (a pageable copy waits for the work queued): every `copy` waits for it.
        with torch.cuda.stream(self.stream):
            self.ending_tables = (torch.from_numpy(tables).pin_memory().to(device, non_blocking=True), string_classes)
        self.buffers = [(torch.empty((capacity, words), dtype=torch.int32, device=device),
                         torch.empty(2 * capacity, dtype=torch.int64, device=device)) for _ in range(2)]
        # Per buffer, an event on the compute stream after the work that read it last was queued.
        self.free: list[Optional[torch.cuda.Event]] = [None, None]
        self.next = 0

    def copy(self, masks: torch.Tensor, indices: torch.Tensor, closing: torch.Tensor, stream: torch.cuda.Stream,
             gate: Optional[GateTicket] = None) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        """`masks`, `indices` and `closing` (pinned host; no more indices nor closing than masks)
        on the device for the work queued on `stream` from now on, until the upload after next:
        the masks, and the indices followed by the closing positions; and the copy's event (the
        host buffers are free after it). With `gate`, the copy waits for it on the device."""
        slot, self.next = self.next, self.next ^ 1
        device_masks = self.buffers[slot][0][:masks.shape[0]]
        device_rows = self.buffers[slot][1][:indices.shape[0] + closing.shape[0]]
        free = self.free[slot]
        with torch.cuda.stream(self.stream):
            if free is not None:
                self.stream.wait_event(free)
            device_rows[:indices.shape[0]].copy_(indices, non_blocking=True)  # ready now: before the wait
            if gate is not None:
                gate.wait(self.stream)
            device_masks.copy_(masks, non_blocking=True)
            if closing.shape[0]:
                device_rows[indices.shape[0]:].copy_(closing, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        stream.wait_event(done)
        # The other buffer's readers (the previous upload's) are all queued on `stream` by now.
        other_free = self.free[slot ^ 1] = torch.cuda.Event()
        other_free.record(stream)
        return device_masks, device_rows, done


def eos_only_mask(eos_tokens: Sequence[int], words: int) -> torch.Tensor:
    """One mask row allowing the EOS tokens only (int32 words, bit t%32 of word t//32)."""
    values = [0] * words
    for token in eos_tokens:
        values[token // 32] |= 1 << (token % 32)
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)
