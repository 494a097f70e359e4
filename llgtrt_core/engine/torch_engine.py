"""The embedded PyTorch engine: continuous batching over a slot KV cache, CPU or CUDA.

One background thread owns the model and runs steps; the event loop only submits, aborts
and reads deltas. A step decodes one token for every running sequence, prefills the requests
admitted since the last step, masks every constrained row in one post-processor call, samples,
and hands each request its token. Finished or aborted sequences leave between steps and the
last slot moves into the hole, so running sequences always fill slots 0..n-1. When a grammar
forces a run of tokens after the sampled one (fast-forward), they are emitted with it and fed
in the next step's forward pass without being sampled (`LlamaForCausalLM.extend`). On CUDA the
cache holds the whole context for as many slots as fit, and decode replays CUDA graphs
(`decode_graphs.py`); the only host sync of a step is reading the sampled tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
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
    TokenDelta,
    TokenLogprob,
)
from llgtrt_core.engine.decode_graphs import DecodeGraphs
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.sampler import BatchSampler, token_logprobs
from llgtrt_core.models.llama import LlamaForCausalLM
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
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return self.cpu_threads or max(1, cores - 1)


@dataclass
class _Sequence:
    request: GenerationRequest
    emit: Callable[[TokenDelta], None]  # thread-safe: puts the delta on the request's asyncio queue
    generator: torch.Generator
    length: int = 0  # positions held in the KV cache
    num_generated: int = 0
    pending_tokens: list[int] = field(default_factory=list)  # sampled (then forced) last step, fed this step
    uncommitted_token: Optional[int] = None  # sampled last step, not yet seen by the constraint
    fast_forward: bool = False  # its constraint's forced tokens are fed without sampling
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # sent with the first delta
    arrival: float = field(default_factory=time.monotonic)  # for the queue-time metric

    def take_prompt_logprobs(self) -> Optional[list[Optional[TokenLogprob]]]:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken


_STOP = object()
_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions projected to the vocabulary at once


class TorchEngine(Engine):
    def __init__(
        self,
        model_dir: Path,
        config: TorchEngineConfig = TorchEngineConfig(),
        post_processor: Optional[LogitsPostProcessor] = None,
        model: Optional[LlamaForCausalLM] = None,  # already built, e.g. random weights for benchmarks
    ):
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
        self._active: set[str] = set()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # index i occupies cache slot i
        self._thread: Optional[threading.Thread] = None
        self.model = model
        self.cache: Optional[KVCache] = None
        self.decode_graphs: Optional[DecodeGraphs] = None
        self.sampler = BatchSampler(config.max_batch_size, self.vocab_size, self.device)
        self._forwarder = post_processor if config.fast_forward and isinstance(post_processor, FastForwarder) else None
        self.num_steps = 0  # forward steps run: what fast-forward saves

    # ---- event-loop side -------------------------------------------------------------

    async def start(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.resolve_cpu_threads())  # process-wide: the engine is its torch user
        if self.model is None:
            self.model = await asyncio.to_thread(load_model, self.model_dir, self.max_model_len, self.dtype,
                                                 self.device)
        cfg = self.model.config
        self.cache = KVCache.for_device(cfg.num_layers, self.config.max_batch_size, cfg.num_kv_heads, cfg.head_dim,
                                        self.max_model_len, self.dtype, self.device)
        if self.device.type == "cuda" and self.config.cuda_graphs:
            self.decode_graphs = DecodeGraphs(self.model, self.cache)
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        self._thread.start()
        logger.info("torch engine ready: %s on %s, batch %d, context %d",
                    cfg.architecture, self.device, self.cache.num_slots, self.max_model_len)

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put((_STOP, None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def num_active(self) -> int:
        return len(self._active)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self._validate(request)
        if self._thread is None:
            raise EngineError("the engine is not running")
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta] = asyncio.Queue()

        def emit(delta: TokenDelta) -> None:
            try:
                loop.call_soon_threadsafe(deltas.put_nowait, delta)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        generator = torch.Generator(self.device)
        if request.sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.sampling.seed)
        self._active.add(request.request_id)
        self._commands.put(("add", _Sequence(request, emit, generator)))
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            self._active.discard(request.request_id)
            if not finished:  # the consumer went away: free the slot
                self.abort(request.request_id)

    def _validate(self, request: GenerationRequest) -> None:
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
            idle = not self._running and not self._waiting
            if not self._drain_commands(block=idle):
                break
            if not self._running and not self._waiting:
                self._record_state()  # aborts may have emptied the batch
                continue
            try:
                with torch.inference_mode():  # the post-processor and sampler edit logits in place
                    self._step()
            except Exception as exc:  # a broken step must not kill the server: fail what was in it
                logger.exception("engine step failed")
                for seq in list(self._running):
                    self._finish(seq, "error", error=f"engine step failed: {exc}")
                self._running.clear()
            self._record_state()
        for seq in [*self._running, *self._waiting]:
            seq.emit(TokenDelta(finish_reason="abort"))
        self._running.clear()
        self._waiting.clear()

    def _record_state(self) -> None:
        held = sum(seq.length for seq in self._running)
        metrics.record_engine_state(len(self._running), len(self._waiting),
                                    held / (self.cache.num_slots * self.max_model_len))

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
        logits = []
        if self._running:
            logits.append(self._decode())
        while self._waiting and len(self._running) < self.cache.num_slots:
            seq = self._waiting.popleft()
            logits.append(self._prefill(seq, slot=len(self._running)).unsqueeze(0))
            self._running.append(seq)
        step_logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        raw_logprobs = self.sampler.raw_logprobs(step_logits)  # before the mask changes them
        self._constrain(step_logits)
        sampled = self.sampler.sample(step_logits, raw_logprobs)
        finished: list[int] = []
        for index, (seq, token, logprob) in enumerate(zip(self._running, sampled.token_ids, sampled.logprobs)):
            reason = self._advance(index, seq, token, logprob)
            if reason is not None:
                finished.append(index)
        for index in reversed(finished):
            self._remove(index)

    def _decode(self) -> torch.Tensor:
        """Every sequence's first pending token in one batched decode; a sequence with forced tokens
        behind it then feeds those through `extend`, whose last logits replace its row."""
        positions = [seq.length for seq in self._running]
        key_len = max(positions) + 1
        self.cache.reserve(max(seq.length + len(seq.pending_tokens) for seq in self._running))
        token_ids = torch.tensor([seq.pending_tokens[0] for seq in self._running], device=self.device)
        positions_tensor = torch.tensor(positions, device=self.device)
        if self.decode_graphs is not None:
            logits = self.decode_graphs.decode(token_ids, positions_tensor, key_len)
        else:
            logits = self.model.decode(token_ids, positions_tensor, key_len, self.cache)
        for slot, seq in enumerate(self._running):
            if len(seq.pending_tokens) > 1:
                forced = torch.tensor(seq.pending_tokens[1:], device=self.device)
                logits[slot] = self.model.extend(forced, self.cache, slot, start=seq.length + 1)
            seq.length += len(seq.pending_tokens)
        return logits

    def _prefill(self, seq: _Sequence, slot: int) -> torch.Tensor:
        """The prompt, followed by the tokens the grammar forces before anything is sampled (a JSON
        schema's `{"name`), which are emitted as the first delta; one token is left to sample."""
        prompt = seq.request.prompt_token_ids
        sampling = seq.request.sampling
        metrics.request_queue_time.observe(time.monotonic() - seq.arrival)
        seq.fast_forward = self._forwarder is not None and seq.request.constraint is not None and not (
            sampling.logprobs is not None and sampling.logprobs_mode == "raw_logprobs")
        forced = self._forced(seq, None, min(sampling.max_tokens, self.max_model_len - len(prompt)) - 1)
        tokens = prompt + forced
        self.cache.reserve(len(tokens))
        self.sampler.add(slot, sampling, prompt, seq.generator)
        self.sampler.record_forced(slot, forced)
        num_top = sampling.prompt_logprobs
        if num_top is None:
            logits = self.model.prefill(torch.tensor(tokens, device=self.device), self.cache, slot)
        else:
            logits, seq.prompt_logprobs = self._prefill_with_prompt_logprobs(tokens, len(prompt), slot, num_top)
        seq.length = len(tokens)
        if forced:
            seq.num_generated = len(forced)
            seq.emit(TokenDelta(forced, logprobs=self._forced_logprobs(seq, forced),
                                prompt_logprobs=seq.take_prompt_logprobs()))
        return logits

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

    def _prefill_with_prompt_logprobs(self, tokens: list[int], prompt_len: int, slot: int, num_top: int
                                      ) -> tuple[torch.Tensor, list[Optional[TokenLogprob]]]:
        """Prefill, also scoring every prompt token under the model (raw logprobs; None for the first);
        `tokens` is the prompt followed by forced tokens, which are not scored.

        The model returns the last position's logits only, so catch its final hidden states and
        project them here, a chunk of positions at a time to bound the (positions, vocab) memory.
        """
        captured: list[torch.Tensor] = []
        hook = self.model.model.norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
        try:
            logits = self.model.prefill(torch.tensor(tokens, device=self.device), self.cache, slot)
        finally:
            hook.remove()
        hidden = captured[0].reshape(-1, captured[0].shape[-1])
        targets = torch.tensor(tokens[1:prompt_len], device=self.device)
        scored: list[Optional[TokenLogprob]] = [None]
        for start in range(0, prompt_len - 1, _PROMPT_LOGPROBS_CHUNK):
            end = min(start + _PROMPT_LOGPROBS_CHUNK, prompt_len - 1)
            chunk_logprobs = self.model.lm_head(hidden[start:end]).float().log_softmax(dim=-1)
            scored += token_logprobs(chunk_logprobs, targets[start:end], [num_top] * (end - start))[1]
        return logits, scored

    def _constrain(self, logits: torch.Tensor) -> None:
        """One post-processor call for every constrained row; a row whose grammar failed ends with an error."""
        rows = [
            ConstrainedRow(seq.request.constraint, index, seq.uncommitted_token)
            for index, seq in enumerate(self._running)
            if seq.request.constraint is not None
        ]
        if not rows:
            return
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.post_processor(rows, logits, stream)
        for row in rows:
            self._running[row.row].uncommitted_token = None

    def _advance(self, row: int, seq: _Sequence, token: int, logprob: Optional[TokenLogprob] = None
                 ) -> Optional[FinishReason]:
        """Hand the sampled token, and the tokens its grammar forces after it, to its request; return a
        finish reason when the sequence is done. A forced run stops short of max_tokens and the context."""
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
        seq.pending_tokens = tokens
        self.sampler.record_forced(row, forced)
        if constraint is not None and not seq.fast_forward:
            seq.uncommitted_token = token
        return None

    def _finish(self, seq: _Sequence, reason: FinishReason, token_ids: Optional[list[int]] = None,
                error: Optional[str] = None, logprobs: Optional[list[TokenLogprob]] = None) -> None:
        seq.emit(TokenDelta(token_ids or [], reason, error, logprobs, seq.take_prompt_logprobs()))

    def _remove(self, index: int) -> None:
        """Free slot `index`, moving the last running sequence into it."""
        last = len(self._running) - 1
        if index != last:
            self.cache.move(last, index, self._running[last].length)
            self.sampler.move(last, index)
            self._running[index] = self._running[last]
        self._running.pop()
