"""TensorRT-LLM logits-processor hooks that drive our engine-wide `LogitsPostProcessor`.

TensorRT-LLM calls them after each forward, from its executor thread, with device logits it
expects to be modified in place:

- TensorRT engine backend: one `BatchedConstraintProcessor` registered at LLM construction,
  called once per step with every request that set `apply_batched_logits_processor=True`:
  `(req_ids, logits: list of (beam, 1, V), token_ids: batch x beam x seq, stream_ptr, client_ids)`.
  All GPU work goes on `torch.cuda.ExternalStream(stream_ptr)`.
- PyTorch backend: a per-request `RequestConstraintProcessor` in `SamplingParams.logits_processor`,
  called once per step as `(req_id, logits (1, 1, V) in the model's dtype, token_ids: beam x seq,
  None, None)` on the current stream, on every tensor-parallel rank. TensorRT-LLM pickles it with
  every request, also at TP 1 in-process.

Both find the request's `Constraint` in a `ConstrainedRequests` table living in this process,
which works when TensorRT-LLM's executor runs in-process (TP 1 with
TLLM_WORKER_USE_SINGLE_PROCESS=1, what `TrtLlmEngine` sets up). When TensorRT-LLM runs its
executor in other processes (TP > 1), the per-request processor is pickled there without that
table; it then rebuilds the serving process's llguidance objects from `GrammarSettings` (the
resolved vocab size, EOS ids, parser limits and log level; once per process) and a matcher from
the grammar text it carries, and masks through the same `MaskPostProcessor` code.

TensorRT-LLM reports sequences, not new tokens: the newest token is `token_ids[beam][-1]`, and
it is committed to the constraint only when the sequence grew by one since the last call. A
sequence that grew by more (several tokens per step) ends the request: its masks would be
wrong. So does the overlap scheduler's lag, which no processor can tell from a prefill chunk:
the adapter refuses constrained requests while it is on. A request that ends, or whose
constraint failed, gets its own end token only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Optional, Sequence

import torch

from llgtrt_core.config import LimitsConfig
from llgtrt_core.engine.interface import ConstrainedRow, Constraint, LogitsPostProcessor

if TYPE_CHECKING:
    from llgtrt_core.constraints.grammar import GrammarCompiler

NEG_INF = float("-inf")


@dataclass
class TrackedConstraint:
    """A constrained request as the processors see it."""

    constraint: Constraint
    seen_len: int  # sequence length (prompt + generated) when the processor last ran
    end_id: int  # the request's own end token: what a failed constraint forces
    sync_error: Optional[str] = None  # set when TensorRT-LLM's tokens and ours diverged

    def advance(self, sequence: Sequence[int]) -> Optional[int]:
        """The token to commit this step: the newest one if exactly one was added since the
        last call, None on the first call or a repeated call without a new token (another
        prefill chunk of the prompt). A sequence that grew by more (several tokens per step,
        as speculative decoding accepts drafts) would leave the masks wrong: the request ends.
        """
        grown = len(sequence) - self.seen_len
        self.seen_len = len(sequence)
        if grown == 1:
            return int(sequence[-1])
        if grown != 0:
            self.sync_error = f"constraint out of sync: the sequence grew by {grown} tokens in one step"
        return None

    @property
    def error(self) -> Optional[str]:
        return self.sync_error or self.constraint.error


class ConstrainedRequests:
    """Constrained requests in flight, keyed by what TensorRT-LLM hands back to the processors
    (the LLM API's request id for the batched processor, our request id for per-request ones).

    The event loop adds and removes entries while TensorRT-LLM's executor thread reads them;
    `lock` also lets the adapter submit a request and register it atomically, so the executor
    can never run a step for a request the table does not know yet.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._by_key: dict[Hashable, TrackedConstraint] = {}

    def add(self, key: Hashable, constraint: Constraint, prompt_len: int, end_id: int) -> TrackedConstraint:
        with self.lock:
            tracked = TrackedConstraint(constraint, prompt_len, end_id)
            self._by_key[key] = tracked
            return tracked

    def remove(self, key: Hashable) -> None:
        with self.lock:
            self._by_key.pop(key, None)

    def get(self, key: Hashable) -> Optional[TrackedConstraint]:
        with self.lock:
            return self._by_key.get(key)

    def __len__(self) -> int:
        return len(self._by_key)


@dataclass
class ProcessorSession:
    """What an in-process processor needs: the table and our post-processor."""

    requests: ConstrainedRequests
    postprocessor: LogitsPostProcessor


# session id -> session, for per-request processors that only carry the id (they are pickled
# by TensorRT-LLM's IPC when its executor runs in another process, where this stays empty)
_SESSIONS: dict[str, ProcessorSession] = {}


def register_session(session_id: str, session: ProcessorSession) -> None:
    _SESSIONS[session_id] = session


def unregister_session(session_id: str) -> None:
    _SESSIONS.pop(session_id, None)


def force_end(rows: torch.Tensor, end_id: int) -> None:
    """Allow only the request's `end_id` in these (n, V) logits rows, so TensorRT-LLM ends the
    sequence at this step: a failed constraint's EOS-only mask allows llguidance's EOS tokens,
    which need not be the request's end token (another stop token, or a model whose chat EOS
    differs). The adapter never passes an end_id outside the vocabulary."""
    rows.fill_(NEG_INF)
    rows[:, end_id] = 0.0


def run_constrained(postprocessor: LogitsPostProcessor, entries: Sequence[tuple[TrackedConstraint, int, Optional[int]]],
                    rows: torch.Tensor, stream: Optional[torch.cuda.Stream]) -> None:
    """Mask `rows` (n, V) for (tracked, row, new_token) entries; a request whose tokens went out
    of sync or whose constraint failed gets its own end token only."""
    live = [ConstrainedRow(t.constraint, row, token) for t, row, token in entries if not t.sync_error]
    if live:
        postprocessor(live, rows, stream)
    for tracked, row, _ in entries:
        if tracked.error:
            force_end(rows[row : row + 1], tracked.end_id)


def copy_mask_to_other_beams(beams: torch.Tensor) -> None:
    """(beam, V): beam 0 was masked; give the other beam rows the same disallowed tokens.

    We never request beam search, so extra rows are padding at TensorRT-LLM's admission width;
    masking them like beam 0 keeps every row of the request within the grammar.
    """
    if beams.shape[0] > 1:
        beams[1:].masked_fill_(torch.isneginf(beams[0]).unsqueeze(0), NEG_INF)


def _stream_context(stream: Optional[torch.cuda.Stream]) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class _RowBatch:
    """Beam-0 rows of TensorRT-LLM's per-request logits as one (N, V) tensor.

    When the rows are equally spaced in one storage (TensorRT-LLM slices them out of one
    buffer) the batch is a strided view and writes land in place; otherwise they are gathered
    into a copy and `write_back` scatters them (one copy each way).
    """

    def __init__(self, per_request: Sequence[torch.Tensor]) -> None:
        self.first_rows = [t.reshape(t.shape[0], t.shape[-1])[0] for t in per_request]
        self.rows = self._strided_view(self.first_rows)
        self.copied = self.rows is None
        if self.rows is None:
            self.rows = torch.stack(self.first_rows)

    @staticmethod
    def _strided_view(rows: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        first = rows[0]
        if len(rows) == 1:
            return first.unsqueeze(0)
        vocab, itemsize = first.shape[0], first.element_size()
        same_layout = all(
            r.dtype == first.dtype
            and r.device == first.device
            and r.stride(0) == 1
            and r.shape[0] == vocab
            and r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            for r in rows
        )
        if not same_layout or first.stride(0) != 1:
            return None
        step_bytes = rows[1].data_ptr() - first.data_ptr()
        if step_bytes < vocab * itemsize or step_bytes % itemsize:
            return None
        if any(b.data_ptr() - a.data_ptr() != step_bytes for a, b in zip(rows, rows[1:])):
            return None
        return first.as_strided((len(rows), vocab), (step_bytes // itemsize, 1))

    def write_back(self) -> None:
        if self.copied:
            for i, row in enumerate(self.first_rows):
                row.copy_(self.rows[i])


class BatchedConstraintProcessor:
    """TensorRT engine backend: `LLM(batched_logits_processor=...)`, one call per step.

    A `tensorrt_llm.sampling_params.BatchedLogitsProcessor` by signature (TensorRT-LLM accepts
    any callable with it); kept free of a tensorrt_llm import so it loads anywhere.
    """

    def __init__(self, session: ProcessorSession) -> None:
        self.session = session

    @property
    def postprocessor(self) -> LogitsPostProcessor:
        return self.session.postprocessor

    def __call__(
        self,
        req_ids: list[int],
        logits: list[torch.Tensor],
        token_ids: list[list[list[int]]],
        stream_ptr: Optional[int],
        client_ids: list[Optional[int]],
    ) -> None:
        if not logits:
            return
        requests = self.session.requests
        with requests.lock:
            tracked = [requests.get(client_id) for client_id in client_ids]
        stream = torch.cuda.ExternalStream(stream_ptr) if logits[0].is_cuda and stream_ptr else None
        with _stream_context(stream):
            batch = _RowBatch(logits)
            entries = [(entry, index, entry.advance(sequences[0]))
                       for index, (entry, sequences) in enumerate(zip(tracked, token_ids))
                       if entry is not None]  # only constrained requests opt in; an unknown id is not ours
            run_constrained(self.session.postprocessor, entries, batch.rows, stream)
            batch.write_back()
            for entry, per_request in zip(tracked, logits):
                if entry is not None:
                    copy_mask_to_other_beams(per_request.reshape(per_request.shape[0], per_request.shape[-1]))


# LLParserLimits' fields: the parser limits the config sets (`llguidance.limits`)
LIMIT_FIELDS = tuple(f.name for f in dataclasses.fields(LimitsConfig))


@dataclass(frozen=True)
class GrammarSettings:
    """The serving process's resolved constraint settings, as plain data a TensorRT-LLM worker
    process rebuilds the same llguidance objects from: the logits width and EOS ids the
    llguidance tokenizer was built with (config `tokenizer.n_vocab_override`,
    `tokenizer.eos_token_ids`) and the compiler's parser limits and log level (`llguidance.*`)."""

    tokenizer_dir: str  # the stored model's top-level tokenizer files
    vocab_size: int  # logits width llguidance assumes
    eos_token_ids: tuple[int, ...]
    limits: tuple[tuple[str, Any], ...]  # (LLParserLimits field, value)
    log_level: int

    @classmethod
    def of(cls, grammars: GrammarCompiler, tokenizer_dir: str) -> GrammarSettings:
        """Read off the compiler that builds the serving process's constraints (and whose
        tokenizer the post-processor masks with), so a worker's cannot differ from them."""
        tokenizer, limits = grammars.tokenizer, grammars.limits
        return cls(
            tokenizer_dir,
            tokenizer.vocab_size,
            tuple(tokenizer.eos_tokens),
            tuple((name, getattr(limits, name)) for name in LIMIT_FIELDS),
            grammars.log_level,
        )


@dataclass(frozen=True)
class WorkerGrammar:
    """What a worker process needs to rebuild a request's constraint: plain data, cheap to pickle."""

    grammar: str  # llguidance grammar text, as compiled by llgtrt_core.constraints
    settings: GrammarSettings


@dataclass(frozen=True)
class _WorkerConstraints:
    """A worker process's counterparts of the serving process's tokenizer, limits and post-processor."""

    tokenizer: Any  # llguidance.LLTokenizer
    limits: Any  # llguidance.LLParserLimits
    postprocessor: LogitsPostProcessor


@functools.lru_cache(maxsize=4)
def _worker_constraints(settings: GrammarSettings) -> _WorkerConstraints:
    """Built once per worker process and settings (the llguidance tokenizer is the costly part)."""
    from transformers import AutoTokenizer

    from llgtrt_core.constraints.grammar import build_ll_tokenizer, parser_limits
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor

    hf_tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_dir)
    tokenizer = build_ll_tokenizer(hf_tokenizer, settings.vocab_size, settings.eos_token_ids)
    postprocessor = MaskPostProcessor(tokenizer, max_batch_size=1)  # called one request at a time
    return _WorkerConstraints(tokenizer, parser_limits(dict(settings.limits)), postprocessor)


# A worker process builds each request's matcher (and, once, the tokenizer) here, from the moment
# the request is unpickled at admission, so the build overlaps the step's forward instead of
# running inside the processor call. One thread: builds never race for the cached tokenizer.
_WORKER_BUILDS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="llgtrt-worker-grammar")


def _build_in_worker(grammar: WorkerGrammar) -> tuple[_WorkerConstraints, Constraint]:
    from llguidance import LLMatcher

    from llgtrt_core.constraints.grammar import GrammarConstraint

    worker = _worker_constraints(grammar.settings)
    # built as the serving process's GrammarCompiler builds it, with the same settings
    matcher = LLMatcher(worker.tokenizer, grammar.grammar, log_level=grammar.settings.log_level, limits=worker.limits)
    return worker, GrammarConstraint(matcher, grammar.grammar)


class RequestConstraintProcessor:
    """PyTorch backend (and TP > 1): one per constrained request, in its SamplingParams.

    A `tensorrt_llm.sampling_params.LogitsProcessor` by signature. TensorRT-LLM pickles it on
    every request: to its worker processes, and even at TP 1 in-process, where its executor
    broadcasts new requests with their processors through `MPIDist.broadcast` (which pickles
    whenever the build has multi-device support). It pickles to its ids, end token and
    `WorkerGrammar` (None when the engine has no grammar settings): in the serving process it
    resolves the session and runs our post-processor on the very `Constraint` the serving layer
    built; in a worker process it rebuilds that constraint from the grammar and settings and runs
    the same code on it. Masks are filled one request at a time (TensorRT-LLM's PyTorch backend
    calls per-request processors one after another).
    """

    def __init__(self, session_id: str, key: Hashable, end_id: int, worker_grammar: Optional[WorkerGrammar] = None) -> None:
        self.session_id = session_id
        self.key = key
        self.end_id = end_id
        self.worker_grammar = worker_grammar
        self._worker_build: Optional[concurrent.futures.Future] = None
        self._worker_tracked: Optional[TrackedConstraint] = None

    def __getstate__(self) -> dict:
        return {"session_id": self.session_id, "key": self.key, "end_id": self.end_id,
                "worker_grammar": self.worker_grammar}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)
        if self.session_id not in _SESSIONS and self.worker_grammar is not None:  # a worker process
            self._worker_build = _WORKER_BUILDS.submit(_build_in_worker, self.worker_grammar)

    def __call__(
        self,
        req_id: int,
        logits: torch.Tensor,
        token_ids: list[list[int]],
        stream_ptr: Optional[int],
        client_id: Optional[int],
    ) -> None:
        beams = logits.reshape(logits.shape[0], logits.shape[-1])
        sequence = token_ids[0]
        session = _SESSIONS.get(self.session_id)
        if session is not None:  # the serving process
            postprocessor, tracked = session.postprocessor, session.requests.get(self.key)
            if tracked is None:
                return  # the request already ended here (finished or aborted): its last logits do not matter
        elif self._worker_build is not None:
            # a worker process: the client then sees `stop` on a grammar error, which cannot travel back
            postprocessor, tracked = self._in_worker(len(sequence))
        else:
            raise RuntimeError(f"constrained request {self.key!r} is unknown to this process")
        stream = torch.cuda.ExternalStream(stream_ptr) if stream_ptr else _current_stream(logits)
        with _stream_context(stream):
            run_constrained(postprocessor, [(tracked, 0, tracked.advance(sequence))], beams[:1], stream)
            copy_mask_to_other_beams(beams)

    def _in_worker(self, prompt_len: int) -> tuple[LogitsPostProcessor, TrackedConstraint]:
        worker, constraint = self._worker_build.result()  # usually done: built while the prefill ran
        if self._worker_tracked is None:
            self._worker_tracked = TrackedConstraint(constraint, prompt_len, self.end_id)
        return worker.postprocessor, self._worker_tracked


def _current_stream(logits: torch.Tensor) -> Optional[torch.cuda.Stream]:
    return torch.cuda.current_stream(logits.device) if logits.is_cuda else None
