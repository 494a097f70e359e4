"""FAKE tensorrt_llm.llmapi.llm: LLM classes, RequestOutput and a toy executor thread.

NOT NVIDIA's code. It mirrors what the adapter relies on in TensorRT-LLM 1.2:
- `LLM(model, tokenizer=None, tokenizer_mode='auto', skip_tokenizer_init=False, ...,
  tensor_parallel_size=1, ..., **kwargs)`, unknown kwargs -> ValueError (TorchLlmArgs /
  TrtLlmArgs field sets, abridged); `generate_async(inputs, sampling_params, streaming=...)`;
  `shutdown()`.
- Without a tokenizer, prompts must be token ids and `end_id` must be set (ValueError).
- The executor runs on its own thread; the TensorRT backend calls the batched processor once a
  step with `(req_ids, [(beam, 1, V)], token_ids, stream_ptr, client_ids)`, client id = the
  LLM API request id, logits sliced out of one buffer; the PyTorch backend calls per-request
  processors as `(req_id, (beam, 1, V), token_ids, None, None)` after checking they take 4-5
  parameters. When TLLM_WORKER_USE_SINGLE_PROCESS is not "1" the sampling params are pickled
  as the real IPC to the worker process would.
- Finish reasons: END_ID -> 'stop' (the end token stays in token_ids), a stop token ->
  'stop' (trimmed), max_tokens -> 'length', abort -> 'cancelled'.
- A step that raises (e.g. in a logits processor) fails every request in it: their iterators
  raise `RequestError`, as TensorRT-LLM's results do through the executor's error handler.

The toy model reads `vocab_size` from `<model>/config.json`; its logits favour token
(last + 1) % V, then (last + 2) % V, and so on.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import torch

from tensorrt_llm.sampling_params import SamplingParams

_COMMON_ARGS = {
    "max_batch_size", "max_num_tokens", "max_seq_len", "kv_cache_config", "batched_logits_processor",
    "guided_decoding_backend", "enable_chunked_prefill", "max_beam_width", "backend",
}
_TORCH_ARGS = _COMMON_ARGS | {"disable_overlap_scheduler", "cuda_graph_config", "attn_backend"}
_TRT_ARGS = _COMMON_ARGS | {"build_config", "extended_runtime_perf_knob_config"}


@dataclass
class KvCacheConfig:
    free_gpu_memory_fraction: Optional[float] = None
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Any] = None
    _last_token_ids_len: int = 0

    @property
    def token_ids_diff(self) -> List[int]:
        return self.token_ids[self._last_token_ids_len:]


class RequestError(RuntimeError):
    """As tensorrt_llm.executor.utils.RequestError: a request the executor failed."""


class RequestOutput:
    """Streaming result: the same object is updated by each response (as in the real API)."""

    def __init__(self, request_id: int, prompt_token_ids: List[int], executor: "_FakeExecutor") -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput(0)]
        self._done = False
        self._executor = executor
        self._aborted = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _deliver(self, tokens: List[int], final: bool, reason: Optional[str], trim: int) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (tokens, final, reason, trim))

    def _fail(self, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, error)

    def __aiter__(self) -> "RequestOutput":
        return self

    async def __anext__(self) -> "RequestOutput":
        if self._done:
            raise StopAsyncIteration
        response = await self._queue.get()
        if isinstance(response, BaseException):
            self._done = True
            raise RequestError(str(response))
        tokens, final, reason, trim = response
        output = self.outputs[0]
        output._last_token_ids_len = len(output.token_ids)
        output.token_ids.extend(tokens)
        self._done = final
        if final:
            output.finish_reason = reason
            if trim:
                output.token_ids = output.token_ids[:-trim]
        return self


@dataclass
class _Request:
    id: int
    prompt: List[int]
    params: SamplingParams
    output: RequestOutput
    generated: List[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    cancelled: bool = False


class _FakeExecutor:
    """Runs every active request one token per step on a background thread."""

    def __init__(self, vocab_size: int, backend: str, batched_processor: Any, beam_rows: int) -> None:
        self.vocab_size = vocab_size
        self.backend = backend
        self.batched_processor = batched_processor
        self.beam_rows = beam_rows
        self.step_count = 0
        self.errors: List[BaseException] = []
        self._new: List[_Request] = []
        self._active: List[_Request] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="fake-trtllm-executor", daemon=True)
        self._thread.start()

    def enqueue(self, request: _Request) -> None:
        with self._wake:
            self._new.append(request)
            self._wake.notify()

    def abort_request(self, request_id: int) -> None:
        with self._wake:
            for request in self._new + self._active:
                if request.id == request_id:
                    request.cancelled = True
            self._wake.notify()

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._new and not self._active:
                    self._wake.wait()
                if self._stopped:
                    return
                self._active += self._new
                self._new = []
                batch = list(self._active)
            try:
                self._step(batch)
            except BaseException as error:  # surfaced to tests through `errors`
                self.errors.append(error)
                for request in batch:
                    request.output._fail(error)
                with self._wake:
                    self._active = []

    def _logits(self, request: _Request) -> torch.Tensor:
        last = (request.prompt + request.generated)[-1]
        ranks = (torch.arange(self.vocab_size) - last - 1) % self.vocab_size
        return (10.0 - ranks.float() * 0.01).clamp(min=0.0)

    def _step(self, batch: List[_Request]) -> None:
        self.step_count += 1
        finished = []
        for request in batch:
            if request.cancelled:
                request.output._deliver([], True, "cancelled", 0)
                finished.append(request)
        batch = [r for r in batch if r not in finished]
        # one buffer, one (beam, 1, V) slice per request: as TensorRT-LLM hands them out
        buffer = torch.stack([self._logits(r) for r in batch for _ in range(self.beam_rows)]) if batch else None
        per_request = [buffer[i * self.beam_rows:(i + 1) * self.beam_rows].unsqueeze(1) for i in range(len(batch))]
        token_ids = [[list(r.prompt + r.generated) for _ in range(self.beam_rows)] for r in batch]
        batched = [i for i, r in enumerate(batch) if r.params.apply_batched_logits_processor]
        if batched:
            if self.backend != "tensorrt" or self.batched_processor is None:
                raise RuntimeError("apply_batched_logits_processor needs a batched processor on the TensorRT backend")
            self.batched_processor([batch[i].id for i in batched], [per_request[i] for i in batched],
                                   [token_ids[i] for i in batched], 0, [batch[i].id for i in batched])
        for i, request in enumerate(batch):
            processors = request.params.logits_processor
            for processor in ([processors] if processors and not isinstance(processors, list) else processors or []):
                assert 4 <= len(inspect.signature(processor).parameters) <= 5
                stream_ptr = 0 if self.backend == "tensorrt" else None
                processor(request.id, per_request[i], token_ids[i], stream_ptr, None)
        for i, request in enumerate(batch):
            token = self._sample(request, per_request[i][0, 0])
            request.generated.append(token)
            params = request.params
            end_id = -1 if params.ignore_eos else params.end_id
            if token == end_id:
                request.output._deliver([token], True, "stop", 0)
            elif token in (params.stop_token_ids or []):
                request.output._deliver([token], True, "stop", 0 if params.include_stop_str_in_output else 1)
            elif len(request.generated) >= params.max_tokens:
                request.output._deliver([token], True, "length", 0)
            else:
                request.output._deliver([token], False, None, 0)
                continue
            finished.append(request)
        with self._wake:
            self._active = [r for r in self._active if r not in finished]

    @staticmethod
    def _sample(request: _Request, logits: torch.Tensor) -> int:
        params = request.params
        if params._greedy_decoding:
            return int(torch.argmax(logits))
        scaled = logits / (params.temperature or 1.0)
        if params.top_k:
            cut = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < cut, float("-inf"))
        return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=request.generator))


class BaseLLM:
    _backend = "pytorch"
    _valid_args = _TORCH_ARGS

    # test knobs, not TensorRT-LLM's: rows per request handed to processors; `submitted` holds
    # each request's SamplingParams as the executor got them
    beam_rows = 1

    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
                 trust_remote_code=False, tensor_parallel_size=1, dtype="auto", revision=None,
                 tokenizer_revision=None, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in self._valid_args:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        if not skip_tokenizer_init:
            raise NotImplementedError("the fake LLM has no tokenizer: pass skip_tokenizer_init=True")
        self.model = str(model)
        self.kwargs = dict(kwargs, tensor_parallel_size=tensor_parallel_size, skip_tokenizer_init=skip_tokenizer_init)
        self.single_process = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") == "1"
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        self.tokenizer = None
        self._ids = itertools.count(1)
        self.submitted: List[SamplingParams] = []
        self._executor: Optional[_FakeExecutor] = _FakeExecutor(
            vocab_size, self._backend, kwargs.get("batched_logits_processor"), self.beam_rows
        )

    @property
    def fake_executor(self) -> _FakeExecutor:
        return self._executor

    def generate_async(self, inputs, sampling_params: Optional[SamplingParams] = None, lora_request=None,
                       prompt_adapter_request=None, streaming: bool = False, **kwargs: Any) -> RequestOutput:
        if self._executor is None:
            raise RuntimeError("LLM is shutting down")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if sampling_params.end_id is None and self.tokenizer is None:
            raise ValueError("tokenizer is required to reset end_id if it is None, "
                             "or you can explicitly specify the end_id for sampling_params")
        if not (isinstance(inputs, list) and all(isinstance(t, int) for t in inputs)):
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        if not self.single_process:  # the real proxy pickles the request to its worker process
            sampling_params = pickle.loads(pickle.dumps(sampling_params))
        self.submitted.append(sampling_params)
        request_id = next(self._ids)
        output = RequestOutput(request_id, list(inputs), self._executor)
        generator = None
        if sampling_params.seed is not None:
            generator = torch.Generator().manual_seed(sampling_params.seed)
        self._executor.enqueue(_Request(request_id, list(inputs), sampling_params, output, generator=generator))
        return output

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


class _TorchLLM(BaseLLM):
    _backend = "pytorch"
    _valid_args = _TORCH_ARGS


class _TrtLLM(BaseLLM):
    _backend = "tensorrt"
    _valid_args = _TRT_ARGS


class LLM(_TorchLLM):
    pass
