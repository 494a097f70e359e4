"""FAKE executor loop of the fake tensorrt_llm: NOT NVIDIA's code.

Runs on a thread of the serving process (TLLM_WORKER_USE_SINGLE_PROCESS=1 at TP 1) or of a
worker subprocess (`_fake_worker`, every other case), as TensorRT-LLM 1.2 places its executor.
What it reproduces, as read in the 1.2-era source:

- Admission pickles each request's logits processors (`executor_request_queue.
  _handle_request_broadcasting` -> `MPIDist.broadcast` -> `safe_broadcast`, which pickles at any
  world size in multi-device builds; "Serialization failed: ..." fails the executor loop), and
  every TP rank runs its own unpickled copy (`model_engine._execute_logit_post_processors` runs
  on every rank of the last PP stage). Rank 0's logits are sampled; ranks whose processors left
  different logits fail the step.
- PyTorch backend: each request's rows are `logits[offset:offset + beams].view(beams, 1, V)` in
  the model's dtype (bfloat16), processors called once per step as `(req_id, rows, token_ids,
  None, None)` after a 4-5 parameter check. With the overlap scheduler on (TorchLlmArgs'
  default) a step's forward, and so its processors, run before the previous step's tokens
  reach the request and before their response is sent: processors see the sequence one step
  behind and the stream lags one step.
- TensorRT engine backend: the batched processor once per step with float32 `(beams, 1, V)`
  slices of one buffer, the client ids, and the stream.
- TorchSampler (PyTorch backend) reads temperature, top_p and top_k only, from one generator
  seeded 42 for all requests; penalties, min_p and per-request seeds are ignored.
- Several tokens per step (`tokens_per_step`, as speculative decoding accepts drafts).
- A step that raises fails every request in it.

The toy model's logits favour token (last + 1) % V, then (last + 2) % V, ...: exact in bfloat16.
"""

from __future__ import annotations

import inspect
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from tensorrt_llm.sampling_params import SamplingParams

# (kind, ...): ("tokens", tokens, final, finish_reason, trim) or ("error", message)
Response = tuple
Respond = Callable[[int, Response], None]

TORCH_SAMPLER_SEED = 42


@dataclass
class ExecutorSpec:
    vocab_size: int
    backend: str  # "pytorch" | "tensorrt"
    ranks: int = 1  # tensor_parallel_size
    beam_rows: int = 1  # rows per request handed to processors
    overlap: bool = False  # PyTorch backend's overlap scheduler
    tokens_per_step: int = 1
    max_seq_len: Optional[int] = None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def logits_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.backend == "pytorch" else torch.float32


@dataclass
class _Request:
    id: int
    prompt: List[int]
    params: SamplingParams
    generator: Optional[torch.Generator]
    processors: Optional[List[list]] = None  # per rank: that rank's unpickled processors
    generated: List[int] = field(default_factory=list)
    appended: int = 0  # generated tokens the request holds on the host (lags with overlap)
    held: Optional[Response] = None  # overlap: this step's response, sent after the next forward
    cancelled: bool = False
    done: bool = False


def broadcast_processors(processors: Any, ranks: int) -> List[list]:
    """What `safe_broadcast` hands each rank: an unpickled copy of the processors."""
    listed = [] if processors is None else processors if isinstance(processors, list) else [processors]
    if not listed:
        return [[] for _ in range(ranks)]
    try:
        payload = pickle.dumps(listed, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        raise RuntimeError(f"Serialization failed: {error}") from error
    return [pickle.loads(payload) for _ in range(ranks)]


class FakeExecutor:
    """Runs every admitted request on a background thread; `respond` gets its responses."""

    def __init__(self, spec: ExecutorSpec, respond: Respond, batched_processor: Any = None) -> None:
        self.spec = spec
        self.respond = respond
        self.batched_processor = batched_processor
        self.step_count = 0
        self.errors: List[BaseException] = []
        self._new: List[_Request] = []
        self._active: List[_Request] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._sampler_generator = torch.Generator().manual_seed(TORCH_SAMPLER_SEED)
        self._thread = threading.Thread(target=self._loop, name="fake-trtllm-executor", daemon=True)
        self._thread.start()

    def submit(self, request_id: int, prompt: List[int], params: SamplingParams) -> None:
        generator = None
        if self.spec.backend == "tensorrt" and params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        with self._wake:
            self._new.append(_Request(request_id, list(prompt), params, generator))
            self._wake.notify()

    def abort(self, request_id: int) -> None:
        with self._wake:
            for request in self._new + self._active:
                if request.id == request_id:
                    request.cancelled = True
            self._wake.notify()

    def pending(self) -> int:
        """Requests admitted or waiting, not yet answered for good."""
        with self._wake:
            return len(self._new) + len(self._active)

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
                admitted, self._new = self._new, []
                self._active += admitted
                batch = list(self._active)
            try:
                for request in admitted:  # the broadcast of new requests, before the step
                    request.processors = broadcast_processors(request.params.logits_processor, self.spec.ranks)
                self._step(batch)
            except BaseException as error:  # surfaced to tests through `errors`
                self.errors.append(error)
                for request in batch:
                    self.respond(request.id, ("error", f"{type(error).__name__}: {error}"))
                with self._wake:
                    self._active = [r for r in self._active if r not in batch]

    def _model_logits(self, sequence: List[int]) -> torch.Tensor:
        vocab = self.spec.vocab_size
        ranks = (torch.arange(vocab) - sequence[-1] - 1) % vocab
        return -ranks.float()  # integers: exact in bfloat16 where it matters (the top 256)

    def _step(self, batch: List[_Request]) -> None:
        spec = self.spec
        self.step_count += 1
        finished = []
        for request in batch:
            if request.done or request.cancelled:
                self._flush(request)
                if request.cancelled and not request.done:
                    self.respond(request.id, ("tokens", [], True, "cancelled", 0))
                finished.append(request)
        live = [r for r in batch if r not in finished]
        if live:
            rows = self._forward(live)
            for i, request in enumerate(live):
                self._flush(request)  # overlap: the previous step's tokens arrive after this forward
                if self._sample(request, rows[i]):
                    request.done = True
                    if not spec.overlap:
                        finished.append(request)
        with self._wake:
            self._active = [r for r in self._active if r not in finished]

    def _forward(self, live: List[_Request]) -> List[torch.Tensor]:
        """Each request's rank-0 logits row after every rank ran its processors."""
        spec = self.spec
        beams = spec.beam_rows
        host = torch.stack([self._model_logits(r.prompt + r.generated) for r in live for _ in range(beams)])
        per_rank = [host.to(spec.device, spec.logits_dtype) for _ in range(spec.ranks)]
        views = [r.prompt + r.generated[: r.appended] for r in live]  # what each request holds
        stream_ptr = torch.cuda.current_stream().cuda_stream if spec.device.type == "cuda" else 0
        for rank, logits in enumerate(per_rank):
            per_request = [logits[i * beams:(i + 1) * beams].view(beams, 1, -1) for i in range(len(live))]
            token_ids = [[list(view) for _ in range(beams)] for view in views]
            batched = [i for i, r in enumerate(live) if r.params.apply_batched_logits_processor]
            if batched:
                if spec.backend != "tensorrt" or self.batched_processor is None:
                    raise RuntimeError("apply_batched_logits_processor needs a batched processor on the TensorRT backend")
                ids = [live[i].id for i in batched]
                self.batched_processor(ids, [per_request[i] for i in batched], [token_ids[i] for i in batched],
                                       stream_ptr, ids)
            for i, request in enumerate(live):
                for processor in request.processors[rank]:
                    assert 4 <= len(inspect.signature(processor).parameters) <= 5
                    ptr = stream_ptr if spec.backend == "tensorrt" else None
                    processor(request.id, per_request[i], token_ids[i], ptr, None)
        for rank, logits in enumerate(per_rank[1:], start=1):
            if not torch.equal(logits, per_rank[0]):
                raise RuntimeError(f"TP rank {rank}'s processors left other logits than rank 0's")
        return [per_rank[0][i * beams].float().cpu() for i in range(len(live))]

    def _flush(self, request: _Request) -> None:
        request.appended = len(request.generated)
        if request.held is not None:
            held, request.held = request.held, None
            self.respond(request.id, held)

    def _sample(self, request: _Request, logits: torch.Tensor) -> bool:
        """Sample this step's tokens; respond (or hold the response); True when finished."""
        params, spec = request.params, self.spec
        end_id = -1 if params.ignore_eos else params.end_id
        tokens: List[int] = []
        final, reason, trim = False, None, 0
        for extra in range(spec.tokens_per_step):
            if extra:  # an accepted draft token: the model's own next token, no processor saw it
                logits = self._model_logits(request.prompt + request.generated)
            token = self._draw(request, logits)
            request.generated.append(token)
            tokens.append(token)
            total = len(request.prompt) + len(request.generated)
            if token == end_id:
                final, reason = True, "stop"
            elif token in (params.stop_token_ids or []):
                final, reason, trim = True, "stop", 0 if params.include_stop_str_in_output else 1
            elif len(request.generated) >= params.max_tokens or (spec.max_seq_len and total >= spec.max_seq_len):
                final, reason = True, "length"
            if final:
                break
        response = ("tokens", tokens, final, reason, trim)
        if not spec.overlap:  # the tokens reach the request before the next forward
            request.appended = len(request.generated)
        if spec.overlap:
            request.held = response
        else:
            self.respond(request.id, response)
        return final

    def _draw(self, request: _Request, logits: torch.Tensor) -> int:
        params = request.params
        if self.spec.backend == "tensorrt" and params.min_tokens and len(request.generated) < params.min_tokens:
            logits = logits.clone()
            logits[params.end_id] = float("-inf")
        if params._greedy_decoding:
            return int(torch.argmax(logits))
        scaled = logits / (params.temperature or 1.0)
        if params.top_k:
            cut = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < cut, float("-inf"))
        generator = request.generator if request.generator is not None else self._sampler_generator
        return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))
