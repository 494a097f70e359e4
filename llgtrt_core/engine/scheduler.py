"""The embedded engine's scheduler: which sequences run, which wait, what each step computes.

Host bookkeeping only, no tensors: `schedule` returns a `StepPlan` and the engine runs it.
Running sequences fill cache rows 0..n-1; one leaving frees its row and the last row moves into
the hole (`on_move` lets the engine move its per-row device state along).

KV memory is handed out in blocks as sequences grow (`kv_cache.py`). With prefix caching
(block_manager.py) a prompt starts with the blocks of its longest cached prefix and is prefilled
from there; a sequence's full blocks join the cache as they are computed (a prompt's after each
prefill chunk, by the engine; generated ones when the sequence leaves its row), so a preempted
sequence usually finds its own blocks again. A request asking for prompt logprobs computes its
whole prompt. A waiting request is admitted when its prompt's blocks are free (cached ones
count), with room to spare for the running sequences' growth while it is prefilled; when a
running sequence needs a block and none is free, the most recently admitted sequence is
preempted: its blocks are freed and it waits at the head of the queue to be recomputed (its
prompt and every token it has emitted prefilled again; nothing is emitted twice).

With `prefill_chunk_tokens` set, a step prefills at most that many prompt tokens: a longer
prompt is prefilled a chunk per step while the running rows keep decoding. That prompt is the
only one in progress; it sits in the cache's prefill row, and joins the running rows once its
last chunk is planned.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Callable, Optional, Protocol

from llgtrt_core import metrics
from llgtrt_core.engine.block_manager import PrefixHit
from llgtrt_core.engine.interface import TokenDelta
from llgtrt_core.engine.sequence import Chunk, Sequence, StepPlan

_NO_PREFIX = PrefixHit((), (), 0)  # not looked up: the whole prompt is computed


class BlockPool(Protocol):
    """The host half of the KV cache the scheduler hands out (`KVCache`)."""

    num_slots: int
    prefill_row: int
    block_size: int

    @property
    def free_blocks(self) -> int: ...
    @property
    def prefix_caching(self) -> bool: ...
    def blocks_held(self, row: int) -> int: ...
    def blocks_for(self, positions: int) -> int: ...
    def lookup(self, tokens: list[int], known: tuple[bytes, ...] = ()) -> PrefixHit: ...
    def allocate_prompt(self, row: int, tokens: list[int], hit: PrefixHit) -> int: ...
    def allocate(self, row: int, positions: int) -> bool: ...
    def short_rows(self, positions: list[int]) -> list[int]: ...
    def commit(self, row: int, tokens: list[int], computed: int) -> None: ...
    def free(self, row: int) -> None: ...
    def move(self, src: int, dst: int) -> None: ...


class Scheduler:
    def __init__(
        self,
        blocks: BlockPool,
        prefill_chunk_tokens: Optional[int],
        prepare: Callable[[Sequence], None],
        on_join: Callable[[Sequence, int], None],
        on_move: Callable[[int, int], None],
    ):
        """prepare: fills a sequence's prompt state the first time it is admitted (its
        prefill_tokens: the prompt, then any tokens its grammar forces before sampling).
        on_join: a sequence starts running in a row. on_move: a running row moved (src, dst)."""
        self.blocks = blocks
        self.prefill_chunk_tokens = prefill_chunk_tokens or None
        self._prepare = prepare
        self._on_join = on_join
        self._on_move = on_move
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index i occupies cache row i
        self.prefilling: Optional[Sequence] = None  # a prompt part-prefilled, in the cache's prefill row
        self._admissions = itertools.count()
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def idle(self) -> bool:
        return not self.running and not self.waiting and self.prefilling is None

    def in_slots(self) -> list[Sequence]:
        """The sequences holding a cache row: running ones, then the prompt in progress."""
        return self.running + ([self.prefilling] if self.prefilling is not None else [])

    def abort(self, request_id: str) -> None:
        """End the request wherever it is (an abort delta), freeing what it holds."""
        if self.prefilling is not None and self.prefilling.request_id == request_id:
            self.prefilling.emit(TokenDelta(finish_reason="abort"))
            self._release_prefilling()
            return
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.emit(TokenDelta(finish_reason="abort"))
                return
        for index, seq in enumerate(self.running):
            if seq.request_id == request_id:
                seq.emit(TokenDelta(finish_reason="abort"))
                self.remove(index)
                return

    def remove(self, index: int) -> None:
        """Free row `index`'s blocks (its full ones cached first) and move the last running sequence into it."""
        last = len(self.running) - 1
        seq = self.running[index]
        self.blocks.commit(index, seq.token_ids, seq.length)
        self.blocks.free(index)
        if index != last:
            self.blocks.move(last, index)
            self._on_move(last, index)
            self.running[index] = self.running[last]
        self.running.pop()

    def clear(self) -> list[Sequence]:
        """Forget every sequence (a failed step or shutdown; the caller frees the blocks); those that
        held a cache row."""
        held = self.in_slots()
        self.running.clear()
        self.prefilling = None
        return held

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, admit: bool = True) -> Optional[StepPlan]:
        """This step's plan; None when nothing can run (a prompt in progress waits for blocks).
        admit=False: waiting requests wait for `admit_ahead` later in the step, unless this step
        prefills a prompt in progress anyway (then they join its pass, as with admit=True)."""
        self._make_room()
        num_decoding = len(self.running)
        chunks = self._plan_prefill(admit)
        if not chunks and not num_decoding:
            return None
        return StepPlan(num_decoding, chunks)

    def admits_next(self, ends_now: Callable[[Sequence], bool], arrived: bool) -> bool:
        """Whether the next step would prefill a prompt: one is in progress, or the first waiting
        one (`arrived`: a request not yet added is on its way) gets a row (rows whose sequence
        `ends_now` count free; asked only when someone waits) and its blocks."""
        if self.prefilling is not None:
            return True
        if not self.waiting and not arrived:
            return False
        if len(self.running) - sum(map(ends_now, self.running)) >= self.blocks.num_slots:
            return False
        return self._fits(self.waiting[0]) if self.waiting else arrived

    def _make_room(self) -> None:
        """Blocks for every position the running rows may write this step: their pending tokens
        and the decode queued ahead of the next. When the pool runs dry,
        the newest sequence is preempted until the rest fit (one always does: the pool holds a
        whole context)."""
        while True:
            wanted = [seq.length + len(seq.pending_tokens) + 1 for seq in self.running]
            if all(self.blocks.allocate(row, wanted[row]) for row in self.blocks.short_rows(wanted)):
                return
            self._preempt(self.prefilling or max(self.running, key=lambda s: s.admission))

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first, to prefill again what it held (recompute)."""
        if seq is self.prefilling:
            held = self._release_prefilling()
        else:
            row = self.running.index(seq)
            held = self.blocks.blocks_held(row)
            self.remove(row)
            seq.prefill_tokens = list(seq.token_ids)  # all emitted: nothing to send once prefilled
            seq.pending_tokens = []
        seq.length = 0
        if seq.prompt_logprobs is not None:  # its prompt's scoring starts over too
            seq.prompt_logprobs = [None]
        self.waiting.appendleft(seq)
        if held:  # an admitted prompt still waiting for its first blocks lost nothing
            self.num_preemptions += 1
            metrics.preemptions.inc()

    def _release_prefilling(self) -> int:
        """Drop the prompt in progress and free the prefill row; the blocks it held."""
        self.prefilling = None
        held = self.blocks.blocks_held(self.blocks.prefill_row)
        self.blocks.free(self.blocks.prefill_row)
        return held

    def _plan_prefill(self, admit: bool) -> list[Chunk]:
        """Admit waiting requests and pick this step's prompt chunks, in row order: whole prompts
        while the token budget and the free blocks last, then the start of the next one, which
        stays in progress in the prefill row (nothing else is admitted until it is done). A prompt
        prefilled to its end this step joins the running sequences now, so the step's constrained
        rows are known before the forward."""
        budget = self.prefill_chunk_tokens or math.inf
        chunks: list[Chunk] = []
        while budget > 0:
            slot = len(self.running)
            seq = self.prefilling or (self._admit_next() if admit or chunks else None)
            if seq is None:
                break
            end = min(len(seq.prefill_tokens), seq.length + budget)
            last = end == len(seq.prefill_tokens)
            # A sequence that samples this step also needs its next position (the decode queued ahead).
            if not self.blocks.allocate(self.blocks.prefill_row, end + last):
                break  # it waits in the prefill row for blocks; running sequences go on
            budget -= end - seq.length
            if last:
                self.blocks.move(self.blocks.prefill_row, slot)
                self._join(seq, slot)
                chunks.append(Chunk(seq, slot, end, last=True))
            else:
                chunks.append(Chunk(seq, self.blocks.prefill_row, end, last=False))
                break
        return chunks

    def admit_ahead(self, max_tokens: int, max_chunk_tokens: int) -> list[Chunk]:
        """Mid-step, with the next decode about to be queued ahead: admit waiting prompts that can
        ride in it (whole, at most `max_chunk_tokens` left to prefill each, `max_tokens` together,
        not scoring their prompt); each joins the running rows now, as a last chunk. A prompt
        admitted that does not qualify stays in progress for the next step's plan."""
        if self.prefill_chunk_tokens:
            max_tokens = min(max_tokens, self.prefill_chunk_tokens)
        chunks: list[Chunk] = []
        while self.prefilling is None:
            seq = self._admit_next()
            if seq is None:
                break
            end = len(seq.prefill_tokens)
            size = end - seq.length
            if (size > min(max_tokens, max_chunk_tokens) or seq.scores_prompt()
                    or not self.blocks.allocate(self.blocks.prefill_row, end + 1)):
                break
            max_tokens -= size
            slot = len(self.running)
            self.blocks.move(self.blocks.prefill_row, slot)
            self._join(seq, slot)
            chunks.append(Chunk(seq, slot, end, last=True))
        return chunks

    def _admit_next(self) -> Optional[Sequence]:
        """The first waiting sequence, admitted into the prefill row if a row and its blocks are
        free (its cached prefix claimed); None otherwise."""
        if not (self.waiting and len(self.running) < self.blocks.num_slots and self._fits(self.waiting[0])):
            return None
        seq = self.prefilling = self.waiting.popleft()  # held here: a failed step ends it
        self._claim_prefix(seq)
        self._admit(seq)
        return seq

    def _fits(self, seq: Sequence) -> bool:
        """Whether the blocks free now hold `seq`'s prompt (its cached prefix shared), with room to
        spare for each running sequence to grow while the prompt is prefilled (a token per prefill
        step), so that they do not take its blocks back before it is done."""
        prompt = seq.prefill_tokens or seq.request.prompt_token_ids
        looks_up = self.blocks.prefix_caching and seq.request.sampling.prompt_logprobs is None
        # A request that waits keeps its prompt: its blocks' names from the last step are reused.
        known = seq.prefix.hashes if seq.prefix is not None else ()
        seq.prefix = self.blocks.lookup(prompt, known) if looks_up else _NO_PREFIX
        tokens = len(prompt) + 1
        uncached = tokens - len(seq.prefix.blocks) * self.blocks.block_size
        steps = math.ceil(uncached / (self.prefill_chunk_tokens or uncached))
        spare = len(self.running) * self.blocks.blocks_for(steps + 1)
        return self.blocks.blocks_for(tokens) - seq.prefix.shared + spare <= self.blocks.free_blocks

    def _claim_prefix(self, seq: Sequence) -> None:
        """Start the prefill row with the blocks of `seq`'s cached prefix (`_fits` looked it up this
        step) and prefill from its end."""
        prompt = seq.prefill_tokens or seq.request.prompt_token_ids
        if seq.prefix is not _NO_PREFIX:
            seq.length = self.blocks.allocate_prompt(self.blocks.prefill_row, prompt, seq.prefix)
            metrics.record_prefix_lookup(len(prompt), seq.length)
        if not seq.token_ids:  # its first admission: what the answer's usage reports
            seq.cached_tokens = seq.length
        seq.prefix = None

    def _admit(self, seq: Sequence) -> None:
        """Mark `seq` admitted; the first time, `prepare` decides its tokens to prefill. A preempted
        sequence prefills its prompt and what it emitted."""
        seq.admission = next(self._admissions)
        if not seq.token_ids:
            self._prepare(seq)

    def _join(self, seq: Sequence, slot: int) -> None:
        self.running.append(seq)
        self.prefilling = None
        self._on_join(seq, slot)
