"""The embedded PyTorch engine: continuous batching over a paged KV cache, CPU or CUDA.

One background thread owns the model and runs steps; callers only submit, abort and read
deltas. A step is nano-vllm's schedule -> run -> postprocess: the `Scheduler` (host only) plans
which rows decode and which prompt chunks are prefilled; the `ConstraintStage` starts the
constrained rows' mask fill on a worker thread; the `ModelRunner` runs the forward pass
meanwhile; the masks are uploaded and the sampler draws (the fused mask + temperature + draw
kernel for rows that need nothing more, the general sampler for the others); each request then
gets its token, with the tokens its grammar forces after it (fast-forward), and finished
sequences leave.

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
are fed by `extend_batch` in the next step. Waiting prompts ride in the decode queued ahead
when they can (under CUDA graphs, short ones: each prompt token a row of the replay,
model_runner.py): they are admitted then, and join the running rows; a step with room in its
queued decode admits none before it (`_rides_ahead`). Without graphs, when the next
step will admit a prompt nothing is queued ahead: that step decodes and prefills in one pass.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

import torch

from llgtrt_core import metrics
from llgtrt_core.engine.constraint_stage import ConstraintStage
from llgtrt_core.engine.compiled_decode import NO_LOCK, CompiledDecode
from llgtrt_core.engine.decode_graphs import DecodeGraphs
from llgtrt_core.engine.dry import apply_dry
from llgtrt_core.engine.interface import (
    Engine,
    EngineError,
    FinishReason,
    GenerationRequest,
    StagedPostProcessor,
    TokenDelta,
    TokenLogprob,
    next_delta,
)
from llgtrt_core.engine.kernel_threads import KernelThreads
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.engine.model_runner import ModelRunner
from llgtrt_core.engine.sampler import BatchSampler
from llgtrt_core.engine.scheduler import Scheduler
from llgtrt_core.engine.sequence import Sequence, StepPlan
from llgtrt_core.engine.step_profile import StepLog, StepPhases, StepTrace
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.kernels import int64_to_device
from llgtrt_core.models.llama import LlamaForCausalLM
from llgtrt_core.models.loader import load_config, load_model
from llgtrt_core.os_threads import name_os_thread

logger = logging.getLogger(__name__)


_STOP = object()
GIL_SWITCH_INTERVAL_S = 0.0005
GIL_SWITCH_INTERVAL_CUDA_S = 0.0001  # see `start`


class TorchEngine(Engine):
    def __init__(
        self,
        model_dir: Path,
        config: TorchEngineConfig = TorchEngineConfig(),
        post_processor: Optional[StagedPostProcessor] = None,
        model: Optional[LlamaForCausalLM] = None,  # already built, e.g. random weights for benchmarks
        deliver: Optional[Callable[[list[tuple[object, TokenDelta]]], None]] = None,
    ):
        """deliver: takes each step's (route, delta) pairs on the engine thread, the routes as given to
        `submit`; default: `generate`'s, one wake-up of each consumer's event loop per step."""
        self.model_dir = Path(model_dir)
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        model_config = load_config(self.model_dir)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[tuple[object, object]] = []  # aborts and shutdown taken mid-step, applied next
        # Deltas emitted by the engine thread since its last delivery: (route, delta).
        self._outbox: list[tuple[object, TokenDelta]] = []
        self._deliver_outbox = deliver or _deliver_to_event_loops
        self._active: set[str] = set()
        self.overlap_steps = config.resolve_overlap_steps(self.device)  # read every step: benchmarks switch it
        # Logits of the decode queued ahead for the running rows (row i: slot i), fed their sampled
        # tokens on the device; None when the next step must decode itself.
        self._ahead: Optional[torch.Tensor] = None
        self._thread: Optional[threading.Thread] = None
        self.model = model
        self.cache: Optional[KVCache] = None
        self.scheduler: Optional[Scheduler] = None
        self.runner: Optional[ModelRunner] = None
        self.sampler = BatchSampler(config.max_batch_size, self.vocab_size, self.device)
        self.constraints = ConstraintStage(post_processor, config.fast_forward, self.device)
        self.num_steps = 0  # forward steps run: what fast-forward saves
        self.num_sit_outs = 0  # draws dropped: a row's mask, filled apart, was not ready (constraint_stage.py)
        self.trace = StepTrace.from_env()
        self.phases = StepPhases(self.trace, StepLog.from_env())  # the engine thread's step loop, phase by phase
        self._ran: dict[str, int] = {}  # what this step ran, for the step log

    # ---- caller side -----------------------------------------------------------------

    async def start(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.resolve_cpu_threads())  # process-wide: the engine is its torch user
        # Process-wide too: the engine thread drops the GIL at every device sync, and while the event
        # loop is busy streaming each re-acquisition waited out the 5 ms default (a 9 ms GPU step took
        # 40 ms at 256 streams, docs/benchmarks/engine.md). On CUDA the mask fill's thread takes it back
        # after each llguidance call while the engine thread hands out tokens, hence 0.1 ms there; on the
        # CPU so short an interval slowed the decode step's background compile (session 18).
        interval = GIL_SWITCH_INTERVAL_CUDA_S if self.device.type == "cuda" else GIL_SWITCH_INTERVAL_S
        sys.setswitchinterval(min(sys.getswitchinterval(), interval))
        if self.model is None:
            self.model = await asyncio.to_thread(load_model, self.model_dir, self.max_model_len, self.dtype,
                                                 self.device, self.config.resolve_weights(self.device))
        cfg = self.model.config
        cpu_kernels = self.model.uses_cpu_kernels()
        if self.device.type == "cpu" and not cpu_kernels:  # our kernels share the lm_head among KernelThreads
            self.model.head_threads = self.config.resolve_cpu_head_threads()
        self.cache = KVCache.for_device(cfg.num_layers, self.config.max_batch_size, cfg.num_kv_heads, cfg.head_dim,
                                        self.max_model_len, self.dtype, self.device,
                                        self.config.kv_cache_free_gpu_memory_fraction, self.config.kv_cache_max_tokens,
                                        prefix_caching=self.config.prefix_caching)
        decode_graphs = None
        if self.device.type == "cuda" and self.config.cuda_graphs:
            started = time.perf_counter()
            decode_graphs = await asyncio.to_thread(DecodeGraphs, self.model, self.cache)
            logger.info("captured %d decode graphs in %.1f s", len(decode_graphs.buckets),
                        time.perf_counter() - started)
        compiled_decode = None
        if self.config.resolve_cpu_compile(self.device):
            # Inductor's GEMM templates replace aten's quantized matmuls only: with our kernels they
            # would find nothing to replace and cost their graphs' compile (docs/benchmarks/cpu.md, session 13).
            compiled_decode = CompiledDecode(self.model, self.cache,
                                             gemm_templates=self.config.cpu_gemm_templates and not cpu_kernels,
                                             prompt_threads=self.config.resolve_cpu_prompt_threads())
            compiled_decode.start()  # the eager step serves until it is compiled
        kernel_threads = KernelThreads(self.config.resolve_cpu_kernel_threads()) if cpu_kernels else None
        if kernel_threads is not None:
            kernel_threads.start()
        self.runner = ModelRunner(self.model, self.cache, self.device, decode_graphs, self.config.mixed_prefill,
                                  compiled_decode, kernel_threads)
        self.scheduler = Scheduler(self.cache, self.config.prefill_chunk_tokens, self._prepare, self._join,
                                   self._move_row)
        self.constraints.start(self.config.device_waits_for_masks)
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
        self.constraints.shutdown()

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions if self.scheduler is not None else 0

    async def stats(self) -> dict[str, object]:
        return self.step_stats()

    def step_stats(self) -> dict[str, object]:
        phases = self.phases.snapshot()
        fill_phases = self.constraints.phases()
        if fill_phases is not None:
            phases.update(fill_phases.snapshot("fill."))
        mixed = self.runner.num_mixed_steps if self.runner is not None else 0
        compiled = self.runner.compiled_decode if self.runner is not None else None
        kernel_threads = self.runner.kernel_threads if self.runner is not None else None
        blocks = self.cache.blocks
        prefix_cache = {"queries": blocks.queries, "hits": blocks.hits, "cached_blocks": blocks.cached_blocks,
                        "evictions": blocks.evictions}
        return {"num_steps": self.num_steps, "num_mixed_steps": mixed, "num_sit_outs": self.num_sit_outs,
                "num_spread_prompt_steps": compiled.num_spread_steps if compiled is not None else 0,
                "num_shared_kernel_steps": kernel_threads.num_shared_steps if kernel_threads is not None else 0,
                "step_phases": phases,
                "prefix_cache": prefix_cache}

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

        self._commands.put(("add", Sequence(request, emit, generator)))

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
        name_os_thread("torch-engine")
        scheduler = self.scheduler
        compiled = self.runner.compiled_decode  # on the CPU: its compile and the steps take turns
        while True:
            if not self._drain_commands(block=scheduler.idle()):
                break
            self.phases.begin()
            if scheduler.idle():
                self._record_state()  # aborts may have emptied the batch
                self._deliver()
                continue
            try:
                # Inference mode: the post-processor and sampler edit logits in place.
                with torch.inference_mode(), compiled.exclusive() if compiled is not None else NO_LOCK:
                    self._step()
            except Exception as exc:  # a broken step must not kill the server: fail what was in it
                logger.exception("engine step failed")
                for seq in scheduler.clear():
                    self._finish(seq, "error", error=f"engine step failed: {exc}")
                self._ahead = None
                self.constraints.discard_ahead()
                self.cache.reset()
            self._record_state()
            self._deliver()
            self.phases.mark("deliver")
            self.phases.end_step({"step": self.num_steps, **self._ran})
        for seq in [*scheduler.clear(), *scheduler.waiting]:
            seq.emit(TokenDelta(finish_reason="abort"))
        scheduler.waiting.clear()
        self._deliver()

    def _deliver(self) -> None:
        """Hand the step's deltas on in one batch (see `_deliver_to_event_loops` for why)."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            self._deliver_outbox(outbox)

    def _record_state(self) -> None:
        metrics.record_engine_state(len(self.scheduler.running), len(self.scheduler.waiting), self.cache.usage,
                                    self.cache.blocks.cached_blocks)

    def _drain_commands(self, block: bool, adds_only: bool = False) -> bool:
        """Apply queued adds and aborts; False once shutdown was asked for. adds_only (mid-step,
        before the rows are advanced): aborts and shutdown are held for the next call."""
        held, self._held = self._held, []
        while True:
            if held:
                kind, payload = held.pop(0)
            else:
                try:
                    kind, payload = self._commands.get(block=block)
                except queue.Empty:
                    return True
            block = False
            if kind == "add":
                self.scheduler.add(payload)
            elif adds_only:
                self._held.append((kind, payload))
            elif kind is _STOP:
                return False
            else:
                self.scheduler.abort(payload)

    def _step(self) -> None:
        self.num_steps += 1
        if self.trace is not None:
            self.trace.at_step(self.num_steps)
        plan = self.scheduler.schedule(admit=not self._rides_ahead())
        self._ran = {}
        if plan is None:  # a prompt in progress waits for blocks
            return
        self.cache.sync_table()
        running = self.scheduler.running  # the prompts prefilled to their end this step joined already
        if self.phases.log is not None:  # nothing to count on the hot path otherwise
            self._ran = {"decode": plan.num_decoding, "prefill": sum(chunk.num_tokens for chunk in plan.chunks),
                         "admitted": sum(chunk.last for chunk in plan.chunks), "waiting": len(self.scheduler.waiting)}
        self.phases.mark("schedule")
        # The host half of the constraint work runs while the forward pass does (the fill drops
        # the GIL); nothing else commits to a matcher until its masks are taken.
        fill = self.constraints.begin(running)
        try:
            ahead, self._ahead = self._ahead, None
            logits = self.runner.forward(plan, running, ahead)
            self.phases.mark("forward")
            if self._ran and self.runner.compiled_decode is not None:  # logging: prompt steps on more threads so far
                self._ran["spread_steps"] = self.runner.compiled_decode.num_spread_steps
            if self._ran and self.runner.kernel_threads is not None:  # logging: steps whose matmuls shared threads so far
                self._ran["shared_steps"] = self.runner.kernel_threads.num_shared_steps
        except BaseException:
            fill.wait()  # the step fails: its fill must be done with the matchers first
            raise
        if logits is None or not self.constraints.device_waits:
            fill.wait()  # else the draw's masks are waited for on the device (constraint_stage.py)
        self.phases.mark("fill_wait")
        self._emit_prefilled(plan)
        if logits is None:  # only part of a prompt ran: nothing to sample
            return
        masks, sitting_out = self.constraints.masks(fill, running, self._stream(), self._may_sit_out)
        if self._ran and sitting_out:  # logging
            self._ran["sat_out"] = len(sitting_out)
        self.phases.mark("mask_upload")
        apply_dry(logits, [(i, seq.token_ids, seq.request.sampling.dry) for i, seq in enumerate(running)
                           if seq.request.sampling.dry is not None])
        pending = self.sampler.sample_async(logits, None, masks, dropped=sitting_out)
        self.phases.mark("sample")
        # The next step's fill commits these tokens as soon as they reach the host, while the next
        # decode is queued, the tokens handed out and the next step scheduled.
        committed = self.overlap_steps and self.constraints.begin_ahead(running, lambda: pending.result().token_ids)
        tokens = self._sit_out(running, sitting_out, pending.tokens)
        fed = self.overlap_steps and self._queue_ahead(running, tokens)
        sampled = pending.result()
        self.phases.mark("gpu_wait")
        if committed:
            self.constraints.tokens_read(sampled.token_ids)
            self.phases.mark("fill_send")
        failed = fill.failures()
        finished: list[int] = []
        for index, (seq, token, logprob) in enumerate(zip(running, sampled.token_ids, sampled.logprobs)):
            if index in failed:
                self._finish(seq, "error", error=f"mask fill failed: {failed[index]}")
                reason: Optional[FinishReason] = "error"
            elif index in sitting_out:
                seq.length += fed  # the decode queued ahead holds its previous token again
                seq.pending_tokens = [] if fed else seq.pending_tokens
                continue
            else:
                reason = self._advance(index, seq, token, logprob, fed, committed)
            if reason is not None:
                finished.append(index)
        for index in reversed(finished):
            self.scheduler.remove(index)
        self.phases.mark("advance")

    def _may_sit_out(self, row: int) -> bool:
        """Whether row `row` may sit this step out (its mask, filled apart, is not ready): its draw is
        made again alike a step later, and its last cached position, which it decodes again, is its
        own (not a block shared through the prefix cache)."""
        seq = self.scheduler.running[row]
        return self.sampler.redraws_alike(row) and not self.cache.shared(row, seq.length - 1)

    def _sit_out(self, running: list[Sequence], rows: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """The rows sitting out step back one position, to decode their previous token again there
        (the same KV rewritten, their logits made again for the draw they dropped); `tokens` (the
        draws, on the device) with theirs put back, for a decode queued ahead."""
        if not rows:
            return tokens
        self.num_sit_outs += len(rows)
        metrics.mask_sit_outs.inc(len(rows))
        previous = []
        for index in rows:
            seq = running[index]
            seq.length -= 1
            seq.pending_tokens = [seq.token_ids[-1]]
            previous.append(seq.token_ids[-1])
        tokens = tokens.clone()
        tokens[int64_to_device(rows, self.device)] = int64_to_device(previous, self.device)
        return tokens

    def _rides_ahead(self) -> bool:
        """Whether this step will queue the next decode ahead with room for prompts to ride in it:
        then requests that arrived wait for `_queue_ahead` to admit them (a step later), rather
        than be prefilled now in a replay of their own, which reads all the weights again for a
        few prompt tokens (at 256 HTTP streams those replays took 7 % of the GPU's time)."""
        running = len(self.scheduler.running)  # none: the rows the decode was queued for ended
        return self._ahead is not None and running > 0 and self.runner.ride_room(running)[0] > 0

    def _queue_ahead(self, running: list[Sequence], tokens: torch.Tensor) -> bool:
        """Queue the next step's decode of the running rows, fed the tokens being sampled, so the GPU
        decodes while the host reads and hands them out. Prompts that arrived can ride in that decode
        (under graphs: short ones, admitted now); without graphs, a step about to admit a prompt
        queues nothing, and the next step decodes and prefills in one pass. Whether it queued."""
        rows = running[:]  # admissions append to `running`
        room = self.runner.ride_room(len(rows))
        if room[0] > 0:
            self._drain_commands(block=False, adds_only=True)
            chunks = self.scheduler.admit_ahead(*room)
            self.cache.sync_table()  # the riders' table rows, before the replay reads them
        elif self.config.mixed_prefill and self.scheduler.admits_next(self._reaches_length,
                                                                      arrived=self._commands.qsize() > 0):
            return False
        else:
            chunks = []
        if self.phases.log is not None:
            self._ran.update(riders=len(chunks), ride_tokens=sum(chunk.num_tokens for chunk in chunks))
        self._ahead = self.runner.decode(rows, tokens, chunks)
        self._emit_prefilled(StepPlan(0, chunks))
        self.phases.mark("decode_ahead")
        return True

    def _reaches_length(self, seq: Sequence) -> bool:
        """Whatever it samples now, `seq` ends this step: at max_tokens, or at the context (which
        bounds prompt + completion; the prompt and all but the new token are cached)."""
        return (seq.num_generated + 1 >= seq.request.sampling.max_tokens
                or seq.length + 1 >= self.max_model_len)

    def _stream(self) -> Optional[torch.cuda.Stream]:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _prepare(self, seq: Sequence) -> None:
        """A request's first admission: its tokens to prefill are the prompt, followed by the tokens
        the grammar forces before anything is sampled (a JSON schema's `{"name`), emitted as the
        first delta once prefilled; one token is left to sample."""
        prompt = seq.request.prompt_token_ids
        sampling = seq.request.sampling
        metrics.request_queue_time.observe(time.monotonic() - seq.arrival)
        seq.fast_forward = self.constraints.forwarder is not None and seq.request.constraint is not None and not (
            sampling.logprobs is not None and sampling.logprobs_mode == "raw_logprobs")
        forced = self.constraints.forced(seq, None, min(sampling.max_tokens, self.max_model_len - len(prompt)) - 1)
        if self.runner.decode_graphs is not None or not self.constraints.forwards_each_token:
            # Past the prefix that rides on the prefill, an eager `extend` of a forced run costs
            # several graph decode steps and holds up the whole batch (constrained time per token
            # was 5.8x the unconstrained at batch 1 on an 8B model): later forced tokens are
            # sampled, the mask allowing only them, one graph step each. So too where the fill
            # process commits the sampled tokens.
            seq.fast_forward = False
        seq.token_ids = list(prompt)
        seq.prefill_tokens = prompt + forced
        seq.num_generated = len(forced)
        if sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token has none

    def _join(self, seq: Sequence, slot: int) -> None:
        """`seq` runs from this step on, in `slot`: its sampler row counts the tokens generated
        so far (forced ones; for a preempted sequence, all it emitted) as if sampled."""
        prompt = seq.request.prompt_token_ids
        self.sampler.add(slot, seq.request.sampling, prompt, seq.generator)
        self.sampler.record_forced(slot, seq.prefill_tokens[len(prompt):])

    def _move_row(self, src: int, dst: int) -> None:
        self.sampler.move(src, dst)
        if self._ahead is not None:
            self._ahead[dst] = self._ahead[src]

    def _emit_prefilled(self, plan: StepPlan) -> None:
        """The full blocks a chunk computed join the prefix cache; a prompt prefilled to its end emits
        its forced tokens (with the prompt logprobs) as its first delta."""
        for chunk in plan.chunks:
            seq = chunk.seq
            self.cache.commit(chunk.row, seq.prefill_tokens, chunk.end)
            if chunk.last:
                forced = seq.prefill_tokens[len(seq.token_ids):]  # none after a preemption
                seq.prefill_tokens = []
                if forced:
                    seq.token_ids += forced
                    seq.emit(seq.delta(forced, logprobs=self._forced_logprobs(seq, forced)))

    @staticmethod
    def _forced_logprobs(seq: Sequence, forced: list[int]) -> Optional[list[TokenLogprob]]:
        """A forced token is the only one its (processed) distribution allows: logprob 0, no alternatives."""
        if seq.request.sampling.logprobs is None:
            return None
        return [TokenLogprob(0.0, ((token, 0.0),) if seq.request.sampling.logprobs else ()) for token in forced]

    def _advance(self, row: int, seq: Sequence, token: int, logprob: Optional[TokenLogprob], fed: bool,
                 committed: bool) -> Optional[FinishReason]:
        """Hand the sampled token, and the tokens its grammar forces after it, to its request; return a
        finish reason when the sequence is done. A forced run stops short of max_tokens and the context.
        fed: the token is being decoded already (queued ahead), so only the forced ones are pending.
        committed: the next step's fill, begun already, commits it to the grammar."""
        constraint = seq.request.constraint
        if constraint is not None and constraint.error is not None:
            self._finish(seq, "error", error=constraint.error)
            return "error"
        sampling = seq.request.sampling
        if token in sampling.stop_token_ids:
            self._finish(seq, "stop")
            return "stop"
        reaches_length = self._reaches_length(seq)
        seq.num_generated += 1
        logprobs = None if logprob is None else [logprob]
        if reaches_length:
            self._finish(seq, "length", [token], logprobs=logprobs)
            return "length"
        forced: list[int] = []  # every row, every step: no call for what only a fast-forwarding row does
        if seq.fast_forward:
            forced = self.constraints.forced(seq, token, min(sampling.max_tokens - seq.num_generated,
                                                             self.max_model_len - seq.length - 1))
        tokens = [token, *forced]
        if logprobs is not None:
            logprobs += self._forced_logprobs(seq, forced)
        seq.num_generated += len(forced)
        if seq.num_generated >= sampling.max_tokens or seq.length + len(tokens) >= self.max_model_len:
            self._finish(seq, "length", tokens, logprobs=logprobs)
            return "length"
        seq.emit(seq.delta(tokens, logprobs=logprobs))
        seq.token_ids += tokens
        seq.pending_tokens = forced if fed else tokens
        seq.length += fed
        if forced:
            self.sampler.record_forced(row, forced)
        if constraint is not None and not seq.fast_forward and not committed:
            seq.uncommitted_token = token
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, token_ids: Optional[list[int]] = None,
                error: Optional[str] = None, logprobs: Optional[list[TokenLogprob]] = None) -> None:
        seq.emit(seq.delta(token_ids or [], reason, error, logprobs))


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

