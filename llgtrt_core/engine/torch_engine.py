"""The embedded PyTorch engine: continuous batching over a paged KV cache, CPU or CUDA.

One background thread owns the model and runs steps; the event loop only submits, aborts
and reads deltas. A step: admit waiting requests, start the constraint post-processor's host
half (commit last step's tokens, fill every constrained row's mask) on a worker thread, run the
forward pass meanwhile (decode one token for every running sequence, prefill the admitted
prompts), join the fill, upload the masks and sample: the fused mask + temperature + draw kernel
for rows that need nothing more, the general sampler for the others. Each request then gets its
token. Finished or aborted sequences leave between steps and the last row moves into the hole,
so running sequences always fill cache rows 0..n-1.

KV memory is handed out in blocks as sequences grow (`kv_cache.py`). A waiting request is
admitted when its prompt's blocks are free, with room to spare for the running sequences' growth
while it is prefilled; when a running sequence needs a block and none is free, the most recently admitted sequence is
preempted: its blocks are freed and it waits at the head of the queue to be recomputed (its
prompt and every token it has emitted prefilled again; nothing is emitted twice).

With `prefill_chunk_tokens` set, a step prefills at most that many prompt tokens: a longer
prompt is prefilled a chunk per step (`LlamaForCausalLM.extend_batch` from where the last chunk
ended) while the running rows keep decoding. That prompt is the only one in progress; it sits
in the cache's prefill row, and joins the running rows once its last chunk is planned.

When a grammar forces a run of tokens after the sampled one (fast-forward), they are emitted
with it and fed in the next step's forward pass without being sampled (`extend_batch`); under CUDA
graphs only the run before the first sampled token is (it rides on the prefill). On CUDA the
cache's blocks are allocated up front from free memory, and decode replays CUDA graphs
(`decode_graphs.py`); the only host sync of a step is reading the sampled tokens.

Overlapped steps (`overlap_steps`, on by default on CUDA): once a step's draw is queued, the
next step's decode of every running row is queued too, fed the sampled tokens on the device,
before the host reads them. The host's per-step work (handing out tokens, the grammar commits,
the next mask fill) then runs while the GPU decodes instead of between decodes. A row that
turns out finished was decoded once for nothing; tokens a grammar forces after the sampled one
are fed by `extend_batch` in the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import queue
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

import torch

from llgtrt_core import metrics
from llgtrt_core.engine.interface import (
    ConstrainedRow,
    Engine,
    EngineError,
    FastForwarder,
    FinishReason,
    GenerationRequest,
    LogitsPostProcessor,
    StagedPostProcessor,
    TokenDelta,
    TokenLogprob,
    next_delta,
)
from llgtrt_core.engine.decode_graphs import DecodeGraphs
from llgtrt_core.engine.dry import apply_dry
from llgtrt_core.engine.kv_cache import CUDA_MEMORY_FRACTION, KVCache
from llgtrt_core.engine.sampler import BatchSampler, token_logprobs
from llgtrt_core.engine.step_profile import StepPhases
from llgtrt_core.kernels import int64_to_device
from llgtrt_core.models.llama import LlamaForCausalLM, Segment
from llgtrt_core.models.loader import load_config, load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchEngineConfig:
    max_batch_size: int = 8
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    device: Optional[str] = None  # default: cuda when available, else cpu
    dtype: Optional[str] = None  # default: bfloat16 on cuda, float32 on cpu
    cpu_threads: Optional[int] = None  # torch intra-op threads on cpu; default: all cores but one
    cuda_graphs: bool = True  # decode under CUDA graphs (cuda only)
    fast_forward: bool = True  # feed the tokens a grammar forces in one forward pass, unsampled
    prefill_chunk_tokens: Optional[int] = None  # prompt tokens prefilled per step; None or 0: whole prompts
    kv_cache_free_gpu_memory_fraction: float = CUDA_MEMORY_FRACTION  # of the memory free once the weights are loaded
    kv_cache_max_tokens: Optional[int] = None  # caps the KV cache; on cpu it fixes its size (else it grows)
    # Queue the next decode before reading a step's tokens (see the module doc); default: on cuda,
    # where the host work then hides behind the GPU's. On cpu nothing runs ahead, so it only costs.
    overlap_steps: Optional[bool] = None

    def resolve_overlap_steps(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.overlap_steps is None else self.overlap_steps

    def resolve_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype:
            return getattr(torch, self.dtype)
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def resolve_cpu_threads(self) -> int:
        """One core is left to the rest of the server (event loop, HTTP, the grammar threads that
        fill masks while the forward pass runs): an OpenMP team stalls at every op while one of its
        threads waits for a core, which made 2-thread decode 3-7x slower than 1 thread on a busy
        2-core machine (docs/benchmarks/engine.md)."""
        return self.cpu_threads or max(1, usable_cores() - 1)


def usable_cores() -> int:
    """CPUs this process may run on (a container's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class _Sequence:
    request: GenerationRequest
    emit: Callable[[TokenDelta], None]  # engine thread: queues the delta for the step's delivery
    generator: torch.Generator
    length: int = 0  # positions held in the KV cache
    token_ids: list[int] = field(default_factory=list)  # prompt + emitted tokens, once admitted
    prefill_tokens: list[int] = field(default_factory=list)  # prompt + forced (or emitted) tokens, until prefilled
    admission: int = -1  # when it was last admitted: preemption takes the newest
    num_generated: int = 0
    pending_tokens: list[int] = field(default_factory=list)  # sampled (then forced) tokens not in the cache yet
    uncommitted_token: Optional[int] = None  # sampled last step, not yet seen by the constraint
    fast_forward: bool = False  # its constraint's forced tokens are fed without sampling
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # sent with the first delta
    arrival: float = field(default_factory=time.monotonic)  # for the queue-time metric

    def take_prompt_logprobs(self) -> Optional[list[Optional[TokenLogprob]]]:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken


@dataclass(frozen=True)
class _Chunk:
    """Prompt positions seq.length..end-1 prefilled into cache row `row` this step."""

    seq: _Sequence
    row: int
    end: int
    last: bool  # the prompt is prefilled to its end: the sequence samples this step


_STOP = object()
GIL_SWITCH_INTERVAL_S = 0.0005
_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions projected to the vocabulary at once
PREFILL_PASS_TOKENS = 8192  # prompt tokens batched into one forward pass (bounds its activations)


class TorchEngine(Engine):
    def __init__(
        self,
        model_dir: Path,
        config: TorchEngineConfig = TorchEngineConfig(),
        post_processor: Optional[LogitsPostProcessor] = None,
        model: Optional[LlamaForCausalLM] = None,  # already built, e.g. random weights for benchmarks
        deliver: Optional[Callable[[list[tuple[object, TokenDelta]]], None]] = None,
    ):
        """deliver: takes each step's (route, delta) pairs on the engine thread, the routes as given to
        `submit`; default: `generate`'s, one wake-up of each consumer's event loop per step."""
        self.model_dir = Path(model_dir)
        self.config = config
        self.post_processor = post_processor
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        model_config = load_config(self.model_dir)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Deltas emitted by the engine thread since its last delivery: (route, delta).
        self._outbox: list[tuple[object, TokenDelta]] = []
        self._deliver_outbox = deliver or _deliver_to_event_loops
        self._active: set[str] = set()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # index i occupies cache row i
        self._prefilling: Optional[_Sequence] = None  # a prompt part-prefilled, in the cache's prefill row
        self._admissions = itertools.count()
        self.overlap_steps = config.resolve_overlap_steps(self.device)  # read every step: benchmarks switch it
        # Logits of the decode queued ahead for the running rows (row i: slot i), fed their sampled
        # tokens on the device; None when the next step must decode itself.
        self._ahead: Optional[torch.Tensor] = None
        self._thread: Optional[threading.Thread] = None
        self.model = model
        self.cache: Optional[KVCache] = None
        self.decode_graphs: Optional[DecodeGraphs] = None
        self.sampler = BatchSampler(config.max_batch_size, self.vocab_size, self.device)
        self._forwarder = post_processor if config.fast_forward and isinstance(post_processor, FastForwarder) else None
        self._staged = post_processor if isinstance(post_processor, StagedPostProcessor) else None
        self._fill_pool: Optional[ThreadPoolExecutor] = None  # runs the staged post-processor's fill
        self.num_steps = 0  # forward steps run: what fast-forward saves
        self.num_preemptions = 0
        self.phases = StepPhases()  # the engine thread's step loop, phase by phase

    # ---- event-loop side -------------------------------------------------------------

    async def start(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.resolve_cpu_threads())  # process-wide: the engine is its torch user
        # Process-wide too: the engine thread drops the GIL at every device sync, and while the event
        # loop is busy streaming each re-acquisition waited out the 5 ms default (a 9 ms GPU step took
        # 40 ms at 256 streams, docs/benchmarks/engine.md).
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        if self.model is None:
            self.model = await asyncio.to_thread(load_model, self.model_dir, self.max_model_len, self.dtype,
                                                 self.device)
        cfg = self.model.config
        self.cache = KVCache.for_device(cfg.num_layers, self.config.max_batch_size, cfg.num_kv_heads, cfg.head_dim,
                                        self.max_model_len, self.dtype, self.device,
                                        self.config.kv_cache_free_gpu_memory_fraction, self.config.kv_cache_max_tokens)
        if self.device.type == "cuda" and self.config.cuda_graphs:
            started = time.perf_counter()
            self.decode_graphs = await asyncio.to_thread(DecodeGraphs, self.model, self.cache)
            logger.info("captured %d decode graphs in %.1f s", len(self.decode_graphs.buckets),
                        time.perf_counter() - started)
        if self._staged is not None:
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        self._thread.start()
        logger.info("torch engine ready: %s on %s, batch %d, context %d, KV cache %s tokens",
                    cfg.architecture, self.device, self.cache.num_slots, self.max_model_len,
                    "growing" if self.cache.growable else (self.cache.num_blocks - 1) * self.cache.block_size)

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put((_STOP, None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        if self._fill_pool is not None:
            self._fill_pool.shutdown()
            self._fill_pool = None

    @property
    def num_active(self) -> int:
        return len(self._active)

    async def stats(self) -> dict[str, object]:
        return self.step_stats()

    def step_stats(self) -> dict[str, object]:
        phases = self.phases.snapshot()
        fill_phases = getattr(self._staged, "phases", None)
        if fill_phases is not None:
            phases.update(fill_phases.snapshot("fill."))
        return {"num_steps": self.num_steps, "step_phases": phases}

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def submit(self, request: GenerationRequest, route: object) -> None:
        """Queue `request` (any thread); its deltas reach `deliver` with `route`. Raises EngineError
        for a request the engine cannot take."""
        self.check(request)
        if self._thread is None:
            raise EngineError("the engine is not running")
        generator = torch.Generator(self.device)
        if request.sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.sampling.seed)

        def emit(delta: TokenDelta) -> None:  # engine thread only, like `_deliver`
            self._outbox.append((route, delta))

        self._commands.put(("add", _Sequence(request, emit, generator)))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        deltas: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self.submit(request, (asyncio.get_running_loop(), deltas))
        self._active.add(request.request_id)
        finished = False
        try:
            while not finished:
                delta = await next_delta(deltas)
                finished = delta.finish_reason is not None
                yield delta
        finally:
            self._active.discard(request.request_id)
            if not finished:  # the consumer went away: free the slot
                self.abort(request.request_id)

    def check(self, request: GenerationRequest) -> None:
        """Raises EngineError for a request this engine cannot take."""
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise EngineError("the prompt is empty")
        if prompt_len >= self.max_model_len:
            raise EngineError(f"the prompt has {prompt_len} tokens; this model's context is {self.max_model_len}")
        if request.sampling.max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")

    # ---- engine thread ---------------------------------------------------------------

    @torch.inference_mode()  # aborts move cache rows too: tensors grown in a step are inference tensors
    def _loop(self) -> None:
        while True:
            if not self._drain_commands(block=self._idle()):
                break
            self.phases.begin()
            if self._idle():
                self._record_state()  # aborts may have emptied the batch
                self._deliver()
                continue
            try:
                with torch.inference_mode():  # the post-processor and sampler edit logits in place
                    self._step()
            except Exception as exc:  # a broken step must not kill the server: fail what was in it
                logger.exception("engine step failed")
                for seq in self._in_slots():
                    self._finish(seq, "error", error=f"engine step failed: {exc}")
                self._running.clear()
                self._prefilling = None
                self._ahead = None
                self.cache.reset()
            self._record_state()
            self._deliver()
            self.phases.mark("deliver")
        for seq in [*self._in_slots(), *self._waiting]:
            seq.emit(TokenDelta(finish_reason="abort"))
        self._deliver()
        self._running.clear()
        self._prefilling = None
        self._waiting.clear()

    def _deliver(self) -> None:
        """Hand the step's deltas on in one batch (see `_deliver_to_event_loops` for why)."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self._deliver_outbox(outbox)

    def _idle(self) -> bool:
        return not self._running and not self._waiting and self._prefilling is None

    def _in_slots(self) -> list[_Sequence]:
        """The sequences holding a cache row: running ones, then the prompt in progress."""
        return self._running + ([self._prefilling] if self._prefilling is not None else [])

    def _record_state(self) -> None:
        metrics.record_engine_state(len(self._running), len(self._waiting), self.cache.usage)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once shutdown was asked for."""
        while True:
            try:
                kind, payload = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind is _STOP:
                return False
            if kind == "add":
                self._waiting.append(payload)
            else:
                self._abort_now(payload)

    def _abort_now(self, request_id: str) -> None:
        if self._prefilling is not None and self._prefilling.request.request_id == request_id:
            self._prefilling.emit(TokenDelta(finish_reason="abort"))
            self._release_prefilling()
            return
        for seq in self._waiting:
            if seq.request.request_id == request_id:
                self._waiting.remove(seq)
                seq.emit(TokenDelta(finish_reason="abort"))
                return
        for index, seq in enumerate(self._running):
            if seq.request.request_id == request_id:
                seq.emit(TokenDelta(finish_reason="abort"))
                self._remove(index)
                return

    def _step(self) -> None:
        self.num_steps += 1
        self._make_room()
        num_decoding = len(self._running)
        chunks = self._plan_prefill()
        if not chunks and not num_decoding:  # a prompt in progress waits for blocks
            return
        self.cache.sync_table()
        # Logits rows: the running sequences, then the prompts prefilled to their end this step.
        rows = [ConstrainedRow(seq.request.constraint, index, seq.uncommitted_token)
                for index, seq in enumerate(self._running) if seq.request.constraint is not None]
        self.phases.mark("schedule")
        # The host half of the constraint work runs while the forward pass does (the fill drops
        # the GIL); nothing else commits to a matcher until it is joined.
        fill = self._fill_pool.submit(self._staged.fill, rows) if rows and self._fill_pool is not None else None
        try:
            logits = self._forward(num_decoding, chunks)
            self.phases.mark("forward")
        finally:
            fill_error = _wait(fill)
        self.phases.mark("fill_wait")
        if logits is None:  # only part of a prompt ran: nothing to sample
            return
        masks, raw_logprobs = None, None
        if fill_error is not None:  # its rows end below; the others go on unmasked
            logger.error("mask fill failed", exc_info=fill_error)
        elif fill is not None:
            masks = self._staged.upload(rows, fill.result(), self.device, self._stream())
        elif rows:
            raw_logprobs = self.sampler.raw_logprobs(logits)  # before the mask changes them
            self.post_processor(rows, logits, self._stream())
        for row in rows:
            self._running[row.row].uncommitted_token = None
        self.phases.mark("mask_upload")
        apply_dry(logits, [(i, seq.token_ids, seq.request.sampling.dry) for i, seq in enumerate(self._running)
                           if seq.request.sampling.dry is not None])
        pending = self.sampler.sample_async(logits, raw_logprobs, masks)
        self.phases.mark("sample")
        fed = self.overlap_steps
        if fed:  # the GPU decodes the sampled tokens while the host reads and hands them out
            self._ahead = self._decode_tokens(self._running, pending.tokens)
            self.phases.mark("decode_ahead")
        sampled = pending.result()
        self.phases.mark("gpu_wait")
        failed = {row.row for row in rows} if fill_error is not None else set()
        finished: list[int] = []
        for index, (seq, token, logprob) in enumerate(zip(self._running, sampled.token_ids, sampled.logprobs)):
            if index in failed:
                self._finish(seq, "error", error=f"mask fill failed: {fill_error}")
                reason: Optional[FinishReason] = "error"
            else:
                reason = self._advance(index, seq, token, logprob, fed)
            if reason is not None:
                finished.append(index)
        for index in reversed(finished):
            self._remove(index)
        self.phases.mark("advance")

    def _stream(self) -> Optional[torch.cuda.Stream]:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _make_room(self) -> None:
        """Blocks for every position the running rows may write this step: their pending tokens
        and the decode queued ahead of the next. When the pool runs dry, the newest sequence is
        preempted until the rest fit (one always does: the pool holds a whole context)."""
        row = 0
        while row < len(self._running):
            seq = self._running[row]
            if self.cache.allocate(row, seq.length + len(seq.pending_tokens) + 1):
                row += 1
                continue
            self._preempt(self._prefilling or max(self._running, key=lambda s: s.admission))
            row = 0

    def _preempt(self, seq: _Sequence) -> None:
        """Free `seq`'s blocks and queue it first, to prefill again what it held (recompute)."""
        if seq is self._prefilling:
            held = self._release_prefilling()
        else:
            row = self._running.index(seq)
            held = self.cache.blocks_held(row)
            self._remove(row)
            seq.prefill_tokens = list(seq.token_ids)  # all emitted: nothing to send once prefilled
            seq.pending_tokens = []
        seq.length = 0
        if seq.prompt_logprobs is not None:  # its prompt's scoring starts over too
            seq.prompt_logprobs = [None]
        self._waiting.appendleft(seq)
        if held:  # an admitted prompt still waiting for its first blocks lost nothing
            self.num_preemptions += 1
            metrics.preemptions.inc()

    def _release_prefilling(self) -> int:
        """Drop the prompt in progress and free the prefill row; the blocks it held."""
        self._prefilling = None
        held = self.cache.blocks_held(self.cache.prefill_row)
        self.cache.free(self.cache.prefill_row)
        return held

    def _plan_prefill(self) -> list[_Chunk]:
        """Admit waiting requests and pick this step's prompt chunks, in row order: whole prompts
        while the token budget and the free blocks last, then the start of the next one, which
        stays in progress in the prefill row (nothing else is admitted until it is done). A prompt
        prefilled to its end this step joins the running sequences now, so the step's constrained
        rows are known before the forward."""
        budget = self.config.prefill_chunk_tokens or math.inf
        chunks: list[_Chunk] = []
        while budget > 0:
            slot = len(self._running)
            if self._prefilling is not None:
                seq = self._prefilling
            elif self._waiting and slot < self.cache.num_slots and self._fits(self._waiting[0]):
                seq = self._prefilling = self._waiting.popleft()  # held here: a failed step ends it
                self._admit(seq)
            else:
                break
            end = min(len(seq.prefill_tokens), seq.length + budget)
            last = end == len(seq.prefill_tokens)
            # A sequence that samples this step also needs its next position (the decode queued ahead).
            if not self.cache.allocate(self.cache.prefill_row, end + last):
                break  # it waits in the prefill row for blocks; running sequences go on
            budget -= end - seq.length
            if last:
                self.cache.move(self.cache.prefill_row, slot)
                self._join(seq, slot)
                chunks.append(_Chunk(seq, slot, end, last=True))
            else:
                chunks.append(_Chunk(seq, self.cache.prefill_row, end, last=False))
                break
        return chunks

    def _fits(self, seq: _Sequence) -> bool:
        """Whether the blocks free now hold `seq`'s prompt, with room to spare for each running
        sequence to grow while the prompt is prefilled (a token per prefill step), so that they do
        not take its blocks back before it is done."""
        tokens = len(seq.prefill_tokens or seq.request.prompt_token_ids) + 1
        steps = math.ceil(tokens / (self.config.prefill_chunk_tokens or tokens))
        spare = len(self._running) * self.cache.blocks_for(steps + 1)
        return self.cache.blocks_for(tokens) + spare <= self.cache.free_blocks

    def _admit(self, seq: _Sequence) -> None:
        """Mark `seq` admitted; the first time, decide its tokens to prefill: the prompt, followed
        by the tokens the grammar forces before anything is sampled (a JSON schema's `{"name`),
        emitted as the first delta once prefilled; one token is left to sample. A preempted
        sequence prefills its prompt and what it emitted."""
        seq.admission = next(self._admissions)
        if seq.token_ids:
            return
        prompt = seq.request.prompt_token_ids
        sampling = seq.request.sampling
        metrics.request_queue_time.observe(time.monotonic() - seq.arrival)
        seq.fast_forward = self._forwarder is not None and seq.request.constraint is not None and not (
            sampling.logprobs is not None and sampling.logprobs_mode == "raw_logprobs")
        forced = self._forced(seq, None, min(sampling.max_tokens, self.max_model_len - len(prompt)) - 1)
        if self.decode_graphs is not None:
            # Past the prefix that rides on the prefill, an eager `extend` of a forced run costs
            # several graph decode steps and holds up the whole batch (constrained time per token
            # was 5.8x the unconstrained at batch 1 on an 8B model): later forced tokens are
            # sampled, the mask allowing only them, one graph step each.
            seq.fast_forward = False
        seq.token_ids = list(prompt)
        seq.prefill_tokens = prompt + forced
        seq.num_generated = len(forced)
        if sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token has none

    def _join(self, seq: _Sequence, slot: int) -> None:
        """`seq` runs from this step on, in `slot`: its sampler row counts the tokens generated
        so far (forced ones; for a preempted sequence, all it emitted) as if sampled."""
        self._running.append(seq)
        self._prefilling = None
        prompt = seq.request.prompt_token_ids
        self.sampler.add(slot, seq.request.sampling, prompt, seq.generator)
        self.sampler.record_forced(slot, seq.prefill_tokens[len(prompt):])

    def _forward(self, num_decoding: int, chunks: list[_Chunk]) -> Optional[torch.Tensor]:
        """Decode the first `num_decoding` running rows, then run the prompt chunks; the logits of
        every row that samples this step, in row order (None when no row does)."""
        logits = []
        ahead, self._ahead = self._ahead, None
        if num_decoding:
            batch = self._running[:num_decoding]
            if ahead is None:
                ahead = self._decode_tokens(batch, int64_to_device([seq.pending_tokens[0] for seq in batch],
                                                                   self.device))
                for seq in batch:
                    seq.length += 1
                    seq.pending_tokens = seq.pending_tokens[1:]  # a copy: the list went out in a delta
            logits.append(self._extend_pending(batch, ahead[:num_decoding]))
        if chunks:
            rows = self._prefill(chunks)
            # Only the last chunk can stop short of its prompt's end (_plan_prefill stops there).
            sampling = rows if chunks[-1].last else rows[:-1]
            if sampling.shape[0]:
                logits.append(sampling)
        if not logits:
            return None
        return torch.cat(logits) if len(logits) > 1 else logits[0]

    def _decode_tokens(self, batch: list[_Sequence], token_ids: torch.Tensor) -> torch.Tensor:
        """One batched decode of `token_ids` (on the device) at each sequence's next position (rows
        0..n-1, their blocks allocated); the caller advances the lengths."""
        positions = [seq.length for seq in batch]
        positions_tensor = int64_to_device(positions, self.device)
        if self.decode_graphs is not None:
            return self.decode_graphs.decode(token_ids, positions_tensor)
        return self.model.decode(token_ids, positions_tensor, max(positions) + 1, self.cache,
                                 self.cache.block_table[: len(batch)])

    def _extend_pending(self, batch: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Feed the tokens still pending after the decoded one (forced by a grammar) through one
        `extend_batch`; each such sequence's row becomes its last pending token's logits."""
        pending = [(slot, seq) for slot, seq in enumerate(batch) if seq.pending_tokens]
        if not pending:
            return logits
        tokens = int64_to_device([t for _, seq in pending for t in seq.pending_tokens], self.device)
        segments = [Segment(slot, seq.length, len(seq.pending_tokens)) for slot, seq in pending]
        slots = int64_to_device([slot for slot, _ in pending], self.device)
        logits[slots] = self.model.extend_batch(tokens, self.cache, segments)
        for _, seq in pending:
            seq.length += len(seq.pending_tokens)
            seq.pending_tokens = []
        return logits

    def _prefill(self, chunks: list[_Chunk]) -> torch.Tensor:
        """Extend each chunk's row with its tokens, several chunks per forward pass (the matmuls
        batched: a wave of prompts is prefilled in a few passes, not one pass each); each chunk's
        last-position logits, in order. A prompt prefilled to its end emits its forced tokens (with
        the prompt logprobs) as its first delta."""
        rows = []
        for batch in _prefill_passes(chunks):
            if _scores_prompt(batch[0]):  # alone in its pass
                seq = batch[0].seq
                tokens = int64_to_device(seq.prefill_tokens[seq.length:batch[0].end], self.device)
                rows.append(self._extend_scoring_prompt(seq, tokens, batch[0].row).unsqueeze(0))
                continue
            tokens = int64_to_device([t for c in batch for t in c.seq.prefill_tokens[c.seq.length:c.end]], self.device)
            segments = [Segment(c.row, c.seq.length, c.end - c.seq.length) for c in batch]
            rows.append(self.model.extend_batch(tokens, self.cache, segments))
        for chunk in chunks:
            seq = chunk.seq
            seq.length = chunk.end
            if chunk.last:
                forced = seq.prefill_tokens[len(seq.token_ids):]  # none after a preemption
                seq.prefill_tokens = []
                if forced:
                    seq.token_ids += forced
                    seq.emit(TokenDelta(forced, logprobs=self._forced_logprobs(seq, forced),
                                        prompt_logprobs=seq.take_prompt_logprobs()))
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _forced(self, seq: _Sequence, token: Optional[int], limit: int) -> list[int]:
        """Commit `token` (None: nothing sampled yet) and return the up to `limit` tokens its grammar
        forces next, committed too: empty unless the sequence fast-forwards. A forced stop token is
        left to the sampler (the mask allows only it), so the request ends with "stop" as usual."""
        if not seq.fast_forward:
            return []
        return self._forwarder.commit_with_forced(seq.request.constraint, token, limit,
                                                  seq.request.sampling.stop_token_ids)

    @staticmethod
    def _forced_logprobs(seq: _Sequence, forced: list[int]) -> Optional[list[TokenLogprob]]:
        """A forced token is the only one its (processed) distribution allows: logprob 0, no alternatives."""
        if seq.request.sampling.logprobs is None:
            return None
        return [TokenLogprob(0.0, ((token, 0.0),) if seq.request.sampling.logprobs else ()) for token in forced]

    def _extend_scoring_prompt(self, seq: _Sequence, tokens: torch.Tensor, row: int) -> torch.Tensor:
        """`extend` with these tokens, also scoring the prompt tokens they predict under the model
        (raw logprobs, appended to seq.prompt_logprobs); forced tokens are not scored.

        The hidden states are projected here a chunk of positions at a time, to bound the
        (positions, vocab) memory.
        """
        start = seq.length
        hidden = self.model.extend_hidden(tokens, self.cache, [Segment(row, start, tokens.shape[0])])
        logits = self.model.lm_head(hidden[-1]).float()
        prompt = seq.request.prompt_token_ids
        scored = min(start + tokens.shape[0], len(prompt) - 1) - start  # position p predicts prompt[p + 1]
        targets = int64_to_device(prompt[start + 1:start + 1 + max(scored, 0)], self.device)
        num_top = seq.request.sampling.prompt_logprobs
        for first in range(0, scored, _PROMPT_LOGPROBS_CHUNK):
            last = min(first + _PROMPT_LOGPROBS_CHUNK, scored)
            chunk_logprobs = self.model.lm_head(hidden[first:last]).float().log_softmax(dim=-1)
            seq.prompt_logprobs += token_logprobs(chunk_logprobs, targets[first:last], [num_top] * (last - first))[1]
        return logits

    def _advance(self, row: int, seq: _Sequence, token: int, logprob: Optional[TokenLogprob], fed: bool
                 ) -> Optional[FinishReason]:
        """Hand the sampled token, and the tokens its grammar forces after it, to its request; return a
        finish reason when the sequence is done. A forced run stops short of max_tokens and the context.
        fed: the token is being decoded already (queued ahead), so only the forced ones are pending."""
        constraint = seq.request.constraint
        if constraint is not None and constraint.error is not None:
            self._finish(seq, "error", error=constraint.error)
            return "error"
        sampling = seq.request.sampling
        if token in sampling.stop_token_ids:
            self._finish(seq, "stop")
            return "stop"
        seq.num_generated += 1
        logprobs = None if logprob is None else [logprob]
        # The context bounds prompt + completion; the prompt and all but this token are cached.
        if seq.num_generated >= sampling.max_tokens or seq.length + 1 >= self.max_model_len:
            self._finish(seq, "length", [token], logprobs=logprobs)
            return "length"
        forced = self._forced(seq, token, min(sampling.max_tokens - seq.num_generated,
                                              self.max_model_len - seq.length - 1))
        tokens = [token, *forced]
        if logprobs is not None:
            logprobs += self._forced_logprobs(seq, forced)
        seq.num_generated += len(forced)
        if seq.num_generated >= sampling.max_tokens or seq.length + len(tokens) >= self.max_model_len:
            self._finish(seq, "length", tokens, logprobs=logprobs)
            return "length"
        seq.emit(TokenDelta(tokens, logprobs=logprobs, prompt_logprobs=seq.take_prompt_logprobs()))
        seq.token_ids += tokens
        seq.pending_tokens = forced if fed else tokens
        seq.length += fed
        self.sampler.record_forced(row, forced)
        if constraint is not None and not seq.fast_forward:
            seq.uncommitted_token = token
        return None

    def _finish(self, seq: _Sequence, reason: FinishReason, token_ids: Optional[list[int]] = None,
                error: Optional[str] = None, logprobs: Optional[list[TokenLogprob]] = None) -> None:
        seq.emit(TokenDelta(token_ids or [], reason, error, logprobs, seq.take_prompt_logprobs()))

    def _remove(self, index: int) -> None:
        """Free row `index`'s blocks and move the last running sequence into it."""
        last = len(self._running) - 1
        self.cache.free(index)
        if index != last:
            self.cache.move(last, index)
            self.sampler.move(last, index)
            self._running[index] = self._running[last]
            if self._ahead is not None:
                self._ahead[index] = self._ahead[last]
        self._running.pop()


def _prefill_passes(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    """Consecutive chunks grouped into forward passes of at most PREFILL_PASS_TOKENS tokens (a longer
    chunk runs alone); a chunk scoring its prompt's logprobs runs alone too."""
    passes: list[list[_Chunk]] = []
    tokens = 0
    for chunk in chunks:
        size = chunk.end - chunk.seq.length
        if not passes or tokens + size > PREFILL_PASS_TOKENS or _scores_prompt(chunk) or _scores_prompt(passes[-1][0]):
            passes.append([chunk])
            tokens = size
        else:
            passes[-1].append(chunk)
            tokens += size
    return passes


def _scores_prompt(chunk: _Chunk) -> bool:
    return chunk.seq.prompt_logprobs is not None  # asked for, and not sent yet


def _deliver_to_event_loops(outbox: list[tuple[object, TokenDelta]]) -> None:
    """`generate`'s delivery: each route is (event loop, queue), and each loop gets one wake-up per
    step, not one per delta: at a few hundred streams the per-delta wake-ups (a self-pipe write and
    a callback each) were the event loop's main cost, and the engine thread waits for the GIL
    while the loop holds it."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]] = {}
    for (loop, deltas), delta in outbox:  # type: ignore[misc]
        by_loop.setdefault(loop, []).append((deltas, delta))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[asyncio.Queue, TokenDelta]]) -> None:
    for deltas, delta in items:
        deltas.put_nowait(delta)


def _wait(future: Optional[Future]) -> Optional[BaseException]:
    """Wait for a mask fill; the exception it raised, if any."""
    return None if future is None else future.exception()
