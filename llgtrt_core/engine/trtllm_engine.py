"""The TensorRT-LLM engine: TensorRT-LLM 1.x driven in-process through its LLM API.

Two backends, as TensorRT-LLM 1.2 has them: `tensorrt_llm.LLM` runs a Hugging Face checkpoint
on its PyTorch backend; `tensorrt_llm._tensorrt_engine.LLM` runs a prebuilt TensorRT engine
directory. We tokenize ourselves, so TensorRT-LLM gets token ids, no tokenizer
(`skip_tokenizer_init=True`), and an explicit `end_id`.

Constraints go through our engine-wide `LogitsPostProcessor` (see `trtllm_processors`): the
TensorRT backend gets one batched processor at construction and constrained requests opt in
with `apply_batched_logits_processor=True`; the PyTorch backend gets a per-request processor.
Both need TensorRT-LLM's executor in this process, which is how this adapter runs it at
tensor_parallel_size 1 (TLLM_WORKER_USE_SINGLE_PROCESS=1); at larger TP the per-request
processor rebuilds its matcher in TensorRT-LLM's worker processes, with the settings of the
`GrammarCompiler` the serving process compiles with.

Each request's responses are read by one task for its whole life, which turns each into a
`TokenDelta` the moment it arrives (TensorRT-LLM updates one output object in place, so the
diff must be taken then) and queues it; `generate` yields from that queue. An abort ends the
stream at once through the same queue, without waiting for TensorRT-LLM's last response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal, Optional

from llgtrt_core.engine.interface import (
    Engine,
    EngineError,
    FinishReason,
    GenerationRequest,
    LogitsPostProcessor,
    SamplingParams,
    TokenDelta,
    next_delta,
)
from llgtrt_core.engine.trtllm_processors import (
    BatchedConstraintProcessor,
    ConstrainedRequests,
    GrammarSettings,
    ProcessorSession,
    RequestConstraintProcessor,
    WorkerGrammar,
    register_session,
    unregister_session,
)

if TYPE_CHECKING:
    from llgtrt_core.constraints.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

Backend = Literal["pytorch", "tensorrt"]

SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"
DEFAULT_MAX_NUM_TOKENS = 8192  # TorchLlmArgs' max_num_tokens when unset

# TensorRT-LLM's CompletionOutput.finish_reason -> ours
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "cancelled": "abort"}


@dataclass
class TrtLlmEngineConfig:
    """KV-cache, batch and parallelism settings, from the service's config."""

    model_dir: str  # HF checkpoint (pytorch backend) or TensorRT engine directory (tensorrt)
    backend: Backend
    vocab_size: int  # logits width
    max_model_len: int  # prompt + completion tokens: the PyTorch backend's max_seq_len
    eos_token_id: int
    tokenizer_dir: Optional[str] = None  # HF tokenizer files; worker processes rebuild grammars from it
    tensor_parallel_size: int = 1
    max_batch_size: Optional[int] = None
    max_num_tokens: Optional[int] = None
    kv_cache_free_gpu_memory_fraction: float = 0.9
    kv_cache_max_tokens: Optional[int] = None
    enable_block_reuse: bool = True
    # TP 1: run TensorRT-LLM's executor in this process, so processors see our constraints
    single_process: bool = True
    # PyTorch backend: the overlap scheduler runs step N+1's forward before step N's tokens
    # reach the requests, so a logits processor would see a sequence one token behind.
    # None: off exactly when constrained requests can arrive (the engine has a post-processor)
    disable_overlap_scheduler: Optional[bool] = None
    # PyTorch backend without chunked prefill: TensorRT-LLM refuses prompts over max_num_tokens
    enable_chunked_prefill: bool = False
    extra_llm_args: dict[str, Any] = field(default_factory=dict)  # passed through to LLM(...)

    @property
    def in_process(self) -> bool:
        return self.single_process and self.tensor_parallel_size == 1

    @property
    def torch_sampler(self) -> bool:
        """PyTorch backend sampling with TorchSampler (sampler_type 'auto' picks it without beam
        search): temperature, top_p and top_k only, one generator for every request."""
        return self.backend == "pytorch" and self.extra_llm_args.get("sampler_type", "auto") in ("auto", "TorchSampler")


def config_for_stored_model(
    model_dir: Path, engine_kind: str, vocab_size: int, context_length: int, eos_token_id: int, **overrides: Any
) -> TrtLlmEngineConfig:
    """Config for a stored model (layout of llgtrt_core.model_store): a checkpoint at the top
    level (engine `tensorrt_llm`) or a TensorRT engine under `engine/` (`tensorrt_llm_engine`)."""
    if engine_kind == "tensorrt_llm":
        backend: Backend = "pytorch"
        weights = model_dir
    elif engine_kind == "tensorrt_llm_engine":
        backend = "tensorrt"
        weights = model_dir / "engine"
    else:
        raise ValueError(f"engine {engine_kind!r} is not a TensorRT-LLM engine kind")
    return TrtLlmEngineConfig(
        model_dir=str(weights),
        backend=backend,
        vocab_size=vocab_size,
        max_model_len=context_length,
        eos_token_id=eos_token_id,
        tokenizer_dir=str(model_dir),
        **overrides,
    )


def trt_sampling_kwargs(sampling: SamplingParams, max_tokens: int, eos_token_id: int) -> dict[str, Any]:
    """Our SamplingParams as keyword arguments of tensorrt_llm.SamplingParams.

    Greedy is `top_k=1` with temperature and top_p unset (what TensorRT-LLM resolves to greedy
    in both backends). Sampling always passes top_p (1.0 = no cut): with top_k and top_p both
    unset TensorRT-LLM 1.x decodes greedily whatever the temperature. Only our stop tokens end
    a request: `end_id` is the EOS when it is one of them, another stop token otherwise, and
    when there are none EOS is ignored (`ignore_eos`). No stop strings: the serving layer
    handles those.
    """
    stops = set(sampling.stop_token_ids)
    end_id = eos_token_id if eos_token_id in stops or not stops else min(stops)
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "end_id": end_id,
        "pad_id": end_id,
        "n": 1,
        "detokenize": False,
    }
    if not stops:
        kwargs["ignore_eos"] = True
    other_stops = sorted(stops - {end_id})
    if other_stops:
        kwargs["stop_token_ids"] = other_stops
    if sampling.greedy:
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = sampling.temperature
        kwargs["top_p"] = sampling.top_p
        if sampling.top_k > 0:
            kwargs["top_k"] = sampling.top_k
    if sampling.seed is not None:
        kwargs["seed"] = sampling.seed
    for name, neutral in _PASSED_THROUGH:
        value = getattr(sampling, name)
        if value != neutral:
            kwargs[name] = value
    return kwargs


# Sampling controls TensorRT-LLM's SamplingParams takes under the same names, with their no-op values.
_PASSED_THROUGH = (
    ("min_p", 0.0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_tokens", 0),
)
# TensorRT-LLM 1.2's TorchSampler (PyTorch backend) reads only temperature, top_p and top_k
# (`sampler._request_get_sampling_params`) and draws every request from one generator seeded 42;
# its min-length check compares prompt + generated tokens and holds back end_id only. So these
# would be dropped or misapplied: refused, each only where it changes the result.
_TORCH_SAMPLER_LACKS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
_TORCH_SAMPLER_LACKS_WHEN_SAMPLING = ("min_p", "seed")  # no effect on an argmax


def built_max_seq_len(engine_dir: str) -> Optional[int]:
    """A built TensorRT engine's `build_config.max_seq_len` (its config.json). TensorRT-LLM
    takes a built engine's sequence limit from there and only warns about a runtime `max_seq_len`."""
    config = json.loads((Path(engine_dir) / "config.json").read_text())
    return config.get("build_config", {}).get("max_seq_len")


def unsupported_sampling(sampling: SamplingParams, torch_sampler: bool) -> Optional[str]:
    """What the adapter or TensorRT-LLM's sampler cannot honour (refused, never silently dropped)."""
    if sampling.logit_bias:
        return "logit_bias is not supported with the TensorRT-LLM engine yet"
    if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
        return "logprobs are not supported with the TensorRT-LLM engine yet"
    neutral = dict(_PASSED_THROUGH, seed=None)
    lacking = _TORCH_SAMPLER_LACKS + (() if sampling.greedy else _TORCH_SAMPLER_LACKS_WHEN_SAMPLING)
    for name in lacking if torch_sampler else ():
        if getattr(sampling, name) != neutral[name]:
            return (f"{name} is not supported by TensorRT-LLM's PyTorch-backend sampler (TorchSampler); "
                    "leave it unset, or serve with sampler_type TRTLLMSampler or a TensorRT engine")
    if not torch_sampler and sampling.min_tokens and len(sampling.stop_token_ids) > 1:
        return "min_tokens with more than one stop token is not supported with TensorRT-LLM (it holds back end_id only)"
    return None


def finish_reason_of(trt_reason: Optional[str]) -> tuple[FinishReason, Optional[str]]:
    """TensorRT-LLM's finish reason ('stop', 'length', 'timeout', 'cancelled') -> ours, with an
    error message for the ones that are failures."""
    reason = _FINISH_REASONS.get(trt_reason or "")
    if reason is not None:
        return reason, None
    if trt_reason == "timeout":
        return "error", "TensorRT-LLM timed the request out"
    return "error", f"TensorRT-LLM finished the request without a known reason ({trt_reason!r})"


def export_import_path() -> None:
    """Make the directory holding llgtrt_core importable in the processes TensorRT-LLM spawns (its
    workers unpickle our processors): as an absolute sys.path entry, which 1.2's MpiPoolSession
    hands its MPI workers (mpi4py's `path=sys.path`), and on PYTHONPATH, for spawns that pass the
    environment only. A multi-node launch starts them before us: the image sets PYTHONPATH for
    that case (docker/trtllm.Dockerfile.j2)."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.append(root)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


@dataclass(frozen=True)
class _WarmUpConstraint:
    """The start-up request's constraint: a grammar any token satisfies, never failing."""

    grammar: str
    error: Optional[str] = None


@dataclass
class _Running:
    output: Any  # tensorrt_llm RequestOutput, updated in place each step
    deltas: asyncio.Queue  # TokenDelta, in order; the one with a finish_reason is the last read
    reader: Optional[asyncio.Future] = None  # the task reading `output` for the request's life
    aborted: bool = False

    def finish_with_abort(self) -> None:
        """End the stream now: stop reading and queue the abort (a delta already queued with a
        finish reason still comes first and ends the stream)."""
        self.aborted = True
        if self.reader is not None:
            self.reader.cancel()
        self.deltas.put_nowait(TokenDelta(finish_reason="abort"))


class TrtLlmEngine(Engine):
    """`Engine` over `tensorrt_llm.LLM`; every method is called from the event loop."""

    def __init__(
        self,
        config: TrtLlmEngineConfig,
        postprocessor: Optional[LogitsPostProcessor] = None,
        grammars: Optional[GrammarCompiler] = None,
    ) -> None:
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_model_len
        self.postprocessor = postprocessor  # the same object can drive the embedded engine
        # what worker processes (TP > 1) rebuild the serving process's constraints with
        self.grammar_settings: Optional[GrammarSettings] = None
        if grammars is not None and config.tokenizer_dir is not None:
            self.grammar_settings = GrammarSettings.of(grammars, config.tokenizer_dir)
        self.constrained = ConstrainedRequests()
        self._session_id = uuid.uuid4().hex
        self._llm: Any = None
        self._running: dict[str, _Running] = {}
        self.batched_processor: Optional[BatchedConstraintProcessor] = None
        if postprocessor is not None:
            session = ProcessorSession(self.constrained, postprocessor)
            register_session(self._session_id, session)
            if config.backend == "tensorrt" and config.in_process:
                self.batched_processor = BatchedConstraintProcessor(session)

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def overlap_scheduler_disabled(self) -> bool:
        """PyTorch backend: whether the overlap scheduler is off, as TensorRT-LLM gets it."""
        config = self.config
        chosen = config.disable_overlap_scheduler
        if chosen is None:
            chosen = self.postprocessor is not None  # off exactly when constrained requests can arrive
        return bool(config.extra_llm_args.get("disable_overlap_scheduler", chosen))

    async def start(self) -> None:
        """Build the LLM on the event loop's thread: TensorRT-LLM may spawn MPI workers and
        install handlers, which it expects to do from the main thread. Blocks until loaded.
        With worker processes, a one-token constrained request then makes each of them build
        its llguidance tokenizer before the first real request needs it."""
        if self._llm is None:
            self._llm = self._build_llm()
            if not self.config.in_process and self.postprocessor is not None and self.grammar_settings is not None:
                await self._warm_up_workers()

    async def _warm_up_workers(self) -> None:
        from llguidance import LLMatcher

        eos = self.config.eos_token_id
        request = GenerationRequest(f"llgtrt-warm-up-{self._session_id}", [eos],
                                    SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=frozenset({eos})),
                                    _WarmUpConstraint(LLMatcher.grammar_from_regex("(.|\n)*")))
        async for delta in self.generate(request):
            if delta.finish_reason == "error":
                raise EngineError(f"TensorRT-LLM's worker processes cannot run constrained requests: {delta.error}")

    def _build_llm(self) -> Any:
        config = self.config
        if config.in_process:
            os.environ.setdefault(SINGLE_PROCESS_ENV, "1")
        else:  # TensorRT-LLM's worker processes unpickle our processors: they must import llgtrt_core
            export_import_path()
        from tensorrt_llm.llmapi import KvCacheConfig

        kv_cache = {"free_gpu_memory_fraction": config.kv_cache_free_gpu_memory_fraction}
        kv_cache["enable_block_reuse"] = config.enable_block_reuse
        if config.kv_cache_max_tokens is not None:
            kv_cache["max_tokens"] = config.kv_cache_max_tokens
        kwargs: dict[str, Any] = {
            "skip_tokenizer_init": True,
            "tensor_parallel_size": config.tensor_parallel_size,
            "kv_cache_config": KvCacheConfig(**kv_cache),
        }
        for name in ("max_batch_size", "max_num_tokens"):
            if getattr(config, name) is not None:
                kwargs[name] = getattr(config, name)
        if config.backend == "tensorrt":
            from tensorrt_llm._tensorrt_engine import LLM

            # the engine's sequence limit was fixed at build time; ours must fit in it
            built = built_max_seq_len(config.model_dir)
            if built is not None and config.max_model_len > built:
                raise EngineError(f"max_model_len {config.max_model_len} exceeds the engine's build max_seq_len "
                                  f"{built}; lower it or rebuild the engine with trtllm-build --max_seq_len")
            if self.batched_processor is not None:
                kwargs["batched_logits_processor"] = self.batched_processor
        else:
            from tensorrt_llm import LLM

            kwargs["max_seq_len"] = config.max_model_len  # sizes its KV cache and bounds every sequence
            kwargs["disable_overlap_scheduler"] = self.overlap_scheduler_disabled
            if config.enable_chunked_prefill:
                kwargs["enable_chunked_prefill"] = True
        kwargs.update(config.extra_llm_args)
        logger.info("loading TensorRT-LLM (%s backend) from %s", config.backend, config.model_dir)
        return LLM(config.model_dir, **kwargs)

    async def shutdown(self) -> None:
        for request_id in list(self._running):
            self.abort(request_id)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)
        unregister_session(self._session_id)

    # --- requests -----------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._running)

    def abort(self, request_id: str) -> None:
        running = self._running.get(request_id)
        if running is not None and not running.aborted:
            running.finish_with_abort()
            running.output.abort()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        output, constraint_key = self._submit(request)
        running = _Running(output, asyncio.Queue())
        running.reader = asyncio.ensure_future(self._read(running, request, constraint_key))
        self._running[request.request_id] = running
        finished = False
        try:
            while not finished:
                delta = await next_delta(running.deltas)  # a consumer that fell behind: one chunk
                finished = delta.finish_reason is not None
                yield delta
        finally:
            running.reader.cancel()
            if not finished and not running.aborted:
                output.abort()  # the consumer closed the stream early
            self._running.pop(request.request_id, None)
            if constraint_key is not None:
                self.constrained.remove(constraint_key)

    async def _read(self, running: _Running, request: GenerationRequest, constraint_key: Any) -> None:
        """The request's one reader: each TensorRT-LLM response becomes a queued delta at once."""
        output, stops = running.output, set(request.sampling.stop_token_ids)
        finished = False
        while not finished:
            try:
                await output.__anext__()
                delta, finished = self._delta(output, request, stops, constraint_key)
            except StopAsyncIteration:
                delta = TokenDelta(finish_reason="error", error="TensorRT-LLM ended the stream without a result")
                finished = True
            except Exception as error:  # the executor's failures arrive here
                delta, finished = TokenDelta(finish_reason="error", error=f"TensorRT-LLM: {error}"), True
            if delta.token_ids or delta.finish_reason:
                running.deltas.put_nowait(delta)

    def _submit(self, request: GenerationRequest) -> tuple[Any, Any]:
        """Submit to TensorRT-LLM; returns the streaming output and the constraint table key."""
        if self._llm is None:
            raise EngineError("the TensorRT-LLM engine is not running")
        if request.request_id in self._running:
            raise EngineError(f"request id {request.request_id!r} is already running")
        prompt = list(request.prompt_token_ids)
        self._check_prompt(prompt)
        from tensorrt_llm import SamplingParams as TrtSamplingParams

        if (reason := unsupported_sampling(request.sampling, self.config.torch_sampler)) is not None:
            raise EngineError(reason)
        room = self.max_model_len - len(prompt)
        kwargs = trt_sampling_kwargs(request.sampling, min(request.sampling.max_tokens, room), self.config.eos_token_id)
        constraint = request.constraint
        if constraint is None:
            return self._generate_async(prompt, TrtSamplingParams(**kwargs)), None
        if self.postprocessor is None:
            raise EngineError("this engine was built without a constraint post-processor")
        if self.config.backend == "pytorch" and not self.overlap_scheduler_disabled:
            # its processors would see each sequence a step behind and mask for the wrong state
            raise EngineError("constrained requests need TensorRT-LLM's overlap scheduler off "
                              "(disable_overlap_scheduler); this engine runs with it on")
        end_id = kwargs["end_id"]
        if self.batched_processor is not None:
            params = TrtSamplingParams(apply_batched_logits_processor=True, **kwargs)
            with self.constrained.lock:  # registered before TensorRT-LLM can run a step for it
                output = self._generate_async(prompt, params)
                self.constrained.add(output.request_id, constraint, len(prompt), end_id)
            return output, output.request_id
        key = request.request_id
        processor = RequestConstraintProcessor(self._session_id, key, end_id, self._worker_grammar(constraint))
        if not self.config.in_process and processor.worker_grammar is None:
            raise EngineError("constrained requests at tensor_parallel_size > 1 need the grammar text "
                              "and the engine built with the grammar compiler and tokenizer_dir")
        self.constrained.add(key, constraint, len(prompt), end_id)
        try:
            output = self._generate_async(prompt, TrtSamplingParams(logits_processor=processor, **kwargs))
        except BaseException:
            self.constrained.remove(key)
            raise
        return output, key

    def _check_prompt(self, prompt: list[int]) -> None:
        """What TensorRT-LLM would refuse in generate_async, said in our terms."""
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) >= self.max_model_len:
            raise EngineError(f"the prompt has {len(prompt)} tokens; the model takes at most {self.max_model_len - 1}")
        config = self.config
        limit = config.max_num_tokens or DEFAULT_MAX_NUM_TOKENS
        if config.backend == "pytorch" and not config.enable_chunked_prefill and len(prompt) > limit:
            raise EngineError(f"the prompt has {len(prompt)} tokens; without chunked prefill TensorRT-LLM takes at "
                              f"most max_num_tokens = {limit} in one step")

    def _generate_async(self, prompt: list[int], params: Any) -> Any:
        """TensorRT-LLM's generate_async; what it raises at once (a request it refuses: ValueError,
        RequestError; shut down: RuntimeError) becomes an EngineError."""
        try:
            return self._llm.generate_async(prompt, params, streaming=True)
        except (ValueError, RuntimeError) as error:  # RequestError is a RuntimeError
            raise EngineError(f"TensorRT-LLM refused the request: {error}") from error

    def _worker_grammar(self, constraint: Any) -> Optional[WorkerGrammar]:
        grammar = getattr(constraint, "grammar", None)
        if not isinstance(grammar, str) or not grammar or self.grammar_settings is None:
            return None
        return WorkerGrammar(grammar, self.grammar_settings)

    def _delta(
        self, output: Any, request: GenerationRequest, stops: set[int], constraint_key: Any
    ) -> tuple[TokenDelta, bool]:
        """The tokens TensorRT-LLM added with its latest response, and whether it was the last."""
        completion = output.outputs[0]
        tokens = list(completion.token_ids_diff)
        tracked = self.constrained.get(constraint_key) if constraint_key is not None else None
        if tracked is not None and tracked.error:
            output.abort()
            while tokens and tokens[-1] == tracked.end_id:
                tokens.pop()  # forced by the processor to end the sequence, not generated
            return TokenDelta(tokens, "error", tracked.error), True
        if not output.finished:
            return TokenDelta(tokens), False
        reason, error = finish_reason_of(completion.finish_reason)
        if reason == "stop" and tokens and tokens[-1] in stops:
            tokens.pop()  # a stop token is not emitted
        return TokenDelta(tokens, reason, error), True
