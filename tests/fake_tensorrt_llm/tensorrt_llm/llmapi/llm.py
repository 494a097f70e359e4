"""FAKE tensorrt_llm.llmapi.llm: LLM classes and RequestOutput over the fake executor.

NOT NVIDIA's code. It mirrors what the adapter relies on in TensorRT-LLM 1.2:
- `LLM(model, tokenizer=None, tokenizer_mode='auto', skip_tokenizer_init=False, ...,
  tensor_parallel_size=1, ..., **kwargs)`, unknown kwargs -> ValueError (TorchLlmArgs /
  TrtLlmArgs field sets, abridged); `generate_async(inputs, sampling_params, streaming=...)`;
  `shutdown()`.
- Where the executor runs (`GenerationExecutor.create`): in this process only with
  TLLM_WORKER_USE_SINGLE_PROCESS=1 at tensor_parallel_size 1; otherwise in a worker process
  (`_fake_worker`), to which each request is pickled.
- `generate_async`'s synchronous checks: without a tokenizer `end_id` must be set
  (ValueError); PyTorch backend without chunked prefill: a prompt over `max_num_tokens`
  (default 8192) -> ValueError (`BaseLLM._check_arguments`); TensorRT engine backend: prompt
  + max_tokens over the engine's build max_seq_len -> ValueError; after shutdown ->
  RuntimeError.
- Finish reasons: END_ID -> 'stop' (the end token stays in token_ids), a stop token ->
  'stop' (trimmed), max_tokens or max_seq_len -> 'length', abort -> 'cancelled'. A failed
  request's iterator raises `RequestError`.

The toy model reads `vocab_size` from `<model>/config.json` (and a TensorRT engine's
`build_config.max_seq_len`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from tensorrt_llm._fake_executor import ExecutorSpec, FakeExecutor, Response
from tensorrt_llm.executor.utils import RequestError
from tensorrt_llm.sampling_params import SamplingParams

_COMMON_ARGS = {
    "max_batch_size", "max_num_tokens", "max_seq_len", "kv_cache_config", "batched_logits_processor",
    "guided_decoding_backend", "enable_chunked_prefill", "max_beam_width", "backend",
}
_TORCH_ARGS = _COMMON_ARGS | {"disable_overlap_scheduler", "cuda_graph_config", "attn_backend", "sampler_type"}
_TRT_ARGS = _COMMON_ARGS | {"build_config", "extended_runtime_perf_knob_config"}
DEFAULT_MAX_NUM_TOKENS = 8192  # TorchLlmArgs / BuildConfig default
FAKE_ROOT = Path(__file__).resolve().parents[2]  # what "installed" means for the worker process


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


class RequestOutput:
    """Streaming result: the same object is updated by each response (as in the real API)."""

    def __init__(self, request_id: int, prompt_token_ids: List[int], executor: Any) -> None:
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
        self._executor.abort(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _deliver(self, response: Response) -> None:  # from the executor's thread
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, response)

    def __aiter__(self) -> "RequestOutput":
        return self

    async def __anext__(self) -> "RequestOutput":
        if self._done:
            raise StopAsyncIteration
        response = await self._queue.get()
        if response[0] == "error":
            self._done = True
            raise RequestError(response[1])
        _, tokens, final, reason, trim = response
        output = self.outputs[0]
        output._last_token_ids_len = len(output.token_ids)
        output.token_ids.extend(tokens)
        self._done = final
        if final:
            output.finish_reason = reason
            if trim:
                output.token_ids = output.token_ids[:-trim]
        return self


class _WorkerProcess:
    """The executor in a worker subprocess; the same methods as FakeExecutor."""

    def __init__(self, spec: ExecutorSpec, respond, batched_processor: Any) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAKE_ROOT), env.get("PYTHONPATH")) if p)
        self._cwd = tempfile.TemporaryDirectory(prefix="fake-trtllm-worker-")
        self._process = subprocess.Popen([sys.executable, "-m", "tensorrt_llm._fake_worker"], cwd=self._cwd.name,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._respond = respond
        self._lock = threading.Lock()
        self._replies: queue.Queue = queue.Queue()
        self._send((asdict(spec), pickle.dumps(batched_processor) if batched_processor is not None else None))
        self._reader = threading.Thread(target=self._read, name="fake-trtllm-proxy", daemon=True)
        self._reader.start()
        if self._replies.get(timeout=120) != ("ready",):
            raise RuntimeError("the fake worker process did not start")

    def _send(self, message: tuple) -> None:
        with self._lock:
            pickle.dump(message, self._process.stdin)
            self._process.stdin.flush()

    def _read(self) -> None:
        while True:
            try:
                request_id, response = pickle.load(self._process.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                return
            if request_id is None:
                self._replies.put(response)
            else:
                self._respond(request_id, response)

    def submit(self, request_id: int, prompt: List[int], params: SamplingParams) -> None:
        self._send(("submit", request_id, prompt, pickle.dumps(params)))  # the proxy's IPC pickles requests

    def abort(self, request_id: int) -> None:
        self._send(("abort", request_id))

    def pending(self) -> int:
        self._send(("pending",))
        return self._replies.get(timeout=30)[1]

    def shutdown(self) -> None:
        try:
            self._send(("shutdown",))
            self._process.stdin.close()
        except OSError:
            pass
        self._process.wait(timeout=30)
        self._cwd.cleanup()


class BaseLLM:
    _backend = "pytorch"
    _valid_args = _TORCH_ARGS

    # test knobs, not TensorRT-LLM's: rows per request handed to processors, tokens per step
    beam_rows = 1
    tokens_per_step = 1

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
        self.tokenizer = None
        config = json.loads((Path(model) / "config.json").read_text())
        self.max_num_tokens = kwargs.get("max_num_tokens") or DEFAULT_MAX_NUM_TOKENS
        self.enable_chunked_prefill = kwargs.get("enable_chunked_prefill", False)
        if self._backend == "tensorrt":
            self.max_seq_len = config.get("build_config", {}).get("max_seq_len")
        else:
            self.max_seq_len = kwargs.get("max_seq_len")
        self.single_process = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS") == "1" and tensor_parallel_size == 1
        spec = ExecutorSpec(
            vocab_size=config["vocab_size"], backend=self._backend, ranks=tensor_parallel_size,
            beam_rows=self.beam_rows, tokens_per_step=self.tokens_per_step, max_seq_len=self.max_seq_len,
            overlap=self._backend == "pytorch" and not kwargs.get("disable_overlap_scheduler", False),
        )
        self._ids = itertools.count(1)
        self._outputs: Dict[int, RequestOutput] = {}
        self.submitted: List[SamplingParams] = []  # as the proxy got them, before any pickling
        executor_kind = FakeExecutor if self.single_process else _WorkerProcess
        self._executor: Any = executor_kind(spec, self._respond, kwargs.get("batched_logits_processor"))

    @property
    def fake_executor(self) -> Any:
        return self._executor

    def _respond(self, request_id: int, response: Response) -> None:
        output = self._outputs.get(request_id)
        if output is not None:
            output._deliver(response)
            if response[0] == "error" or response[2]:
                self._outputs.pop(request_id, None)

    def generate_async(self, inputs, sampling_params: Optional[SamplingParams] = None, lora_request=None,
                       prompt_adapter_request=None, streaming: bool = False, **kwargs: Any) -> RequestOutput:
        if self._executor is None:
            raise RuntimeError("LLM is shutting down or has been shut down")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if sampling_params.end_id is None and self.tokenizer is None:
            raise ValueError("tokenizer is required to reset end_id if it is None, "
                             "or you can explicitly specify the end_id for sampling_params")
        if not (isinstance(inputs, list) and all(isinstance(t, int) for t in inputs)):
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        prompt_len = len(inputs)
        if self._backend == "pytorch" and not self.enable_chunked_prefill and prompt_len > self.max_num_tokens:
            raise ValueError(f"The sum of prompt length ({float(prompt_len)}), query length (0) should not exceed "
                             f"max_num_tokens ({self.max_num_tokens})")
        if (self._backend == "tensorrt" and self.max_seq_len
                and prompt_len + sampling_params.max_tokens > self.max_seq_len):
            raise ValueError(f"The sum of prompt length ({float(prompt_len)}) and query length (0) max_tokens "
                             f"({sampling_params.max_tokens}) should not exceed max_seq_len ({self.max_seq_len})")
        self.submitted.append(sampling_params)
        request_id = next(self._ids)
        output = RequestOutput(request_id, list(inputs), self._executor)
        self._outputs[request_id] = output
        try:
            self._executor.submit(request_id, list(inputs), sampling_params)
        except BaseException:
            self._outputs.pop(request_id, None)
            raise
        return output

    def shutdown(self) -> None:
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.shutdown()


class _TorchLLM(BaseLLM):
    _backend = "pytorch"
    _valid_args = _TORCH_ARGS


class _TrtLLM(BaseLLM):
    _backend = "tensorrt"
    _valid_args = _TRT_ARGS


class LLM(_TorchLLM):
    pass
