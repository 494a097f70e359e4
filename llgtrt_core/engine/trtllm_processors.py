"""TensorRT-LLM logits-processor hooks that drive our engine-wide `LogitsPostProcessor`.

TensorRT-LLM calls them after each forward, from its executor thread, with device logits it
expects to be modified in place:

- TensorRT engine backend: one `BatchedConstraintProcessor` registered at LLM construction,
  called once per step with every request that set `apply_batched_logits_processor=True`:
  `(req_ids, logits: list of (beam, 1, V), token_ids: batch x beam x seq, stream_ptr, client_ids)`.
  All GPU work goes on `torch.cuda.ExternalStream(stream_ptr)`.
- PyTorch backend: a per-request `RequestConstraintProcessor` in `SamplingParams.logits_processor`,
  called as `(req_id, logits (beam, 1, V), token_ids: beam x seq, None, None)` on the current stream.

Both find the request's `Constraint` in a `ConstrainedRequests` table living in this process,
which works when TensorRT-LLM's executor runs in-process (TP 1 with
TLLM_WORKER_USE_SINGLE_PROCESS=1, what `TrtLlmEngine` sets up). When TensorRT-LLM runs its
executor in other processes (TP > 1), the per-request processor is pickled there without that
table; it then rebuilds the serving process's llguidance objects from `GrammarSettings` (the
resolved vocab size, EOS ids, parser limits and log level; once per process) and a matcher from
the grammar text it carries, and masks through the same `MaskPostProcessor` code.

TensorRT-LLM reports sequences, not new tokens: the newest token is `token_ids[beam][-1]`, and
it is committed to the constraint only when the sequence grew since the last call, so a
repeated call within one step never commits twice.
"""

from __future__ import annotations

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
    sync_error: Optional[str] = None  # set when TensorRT-LLM's tokens and ours diverged

    def advance(self, sequence: Sequence[int]) -> Optional[int]:
        """The token to commit this step: the newest one if exactly one was added since the
        last call, None on the first call or a repeated call within the same step."""
        grown = len(sequence) - self.seen_len
        self.seen_len = len(sequence)
        if grown == 1:
            return int(sequence[-1])
        if grown != 0:
            self.sync_error = f"constraint out of sync: sequence grew by {grown} tokens in one step"
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

    def add(self, key: Hashable, constraint: Constraint, prompt_len: int) -> TrackedConstraint:
        with self.lock:
            tracked = TrackedConstraint(constraint, prompt_len)
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
    """What an in-process processor needs: the table, our post-processor, the end token."""

    requests: ConstrainedRequests
    postprocessor: LogitsPostProcessor
    end_id: int  # forced when tokens go out of sync, so TensorRT-LLM ends the sequence


# session id -> session, for per-request processors that only carry the id (they are pickled
# by TensorRT-LLM's IPC when its executor runs in another process, where this stays empty)
_SESSIONS: dict[str, ProcessorSession] = {}


def register_session(session_id: str, session: ProcessorSession) -> None:
    _SESSIONS[session_id] = session


def unregister_session(session_id: str) -> None:
    _SESSIONS.pop(session_id, None)


def force_end(rows: torch.Tensor, end_id: int) -> None:
    """Allow only `end_id` in these (n, V) logits rows: a failed constraint ends its sequence."""
    rows.fill_(NEG_INF)
    if 0 <= end_id < rows.shape[-1]:
        rows[:, end_id] = 0.0


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
            rows = []
            for index, (entry, sequences) in enumerate(zip(tracked, token_ids)):
                if entry is None:  # only constrained requests opt in; an unknown id is not ours
                    continue
                new_token = entry.advance(sequences[0])
                if entry.sync_error:
                    force_end(batch.rows[index : index + 1], self.session.end_id)
                else:  # a failed constraint still goes in: the post-processor masks it to EOS
                    rows.append(ConstrainedRow(entry.constraint, index, new_token))
            if rows:
                self.session.postprocessor(rows, batch.rows, stream)
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
    session: ProcessorSession  # its table stays empty: each processor tracks its own request


@functools.lru_cache(maxsize=4)
def _worker_constraints(settings: GrammarSettings) -> _WorkerConstraints:
    """Built once per worker process and settings (the llguidance tokenizer is the costly part)."""
    from transformers import AutoTokenizer

    from llgtrt_core.constraints.grammar import build_ll_tokenizer, parser_limits
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor

    hf_tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_dir)
    tokenizer = build_ll_tokenizer(hf_tokenizer, settings.vocab_size, settings.eos_token_ids)
    postprocessor = MaskPostProcessor(tokenizer, max_batch_size=1)  # called one request at a time
    session = ProcessorSession(ConstrainedRequests(), postprocessor, settings.eos_token_ids[0])
    return _WorkerConstraints(tokenizer, parser_limits(dict(settings.limits)), session)


class RequestConstraintProcessor:
    """PyTorch backend (and TP > 1): one per constrained request, in its SamplingParams.

    A `tensorrt_llm.sampling_params.LogitsProcessor` by signature. It pickles to its ids and
    `WorkerGrammar` only: in this process it resolves the session and runs our post-processor
    on the very `Constraint` the serving layer built; in a TensorRT-LLM worker process it
    rebuilds that constraint from the grammar and settings and runs the same code on it. Masks
    are filled one request at a time (TensorRT-LLM's PyTorch backend calls per-request
    processors one after another).
    """

    def __init__(self, session_id: str, key: Hashable, worker_grammar: Optional[WorkerGrammar] = None) -> None:
        self.session_id = session_id
        self.key = key
        self.worker_grammar = worker_grammar
        self._worker_tracked: Optional[TrackedConstraint] = None

    def __getstate__(self) -> dict:
        if self.worker_grammar is None:
            raise TypeError(
                "this constrained request cannot run in a TensorRT-LLM worker process: its constraint "
                "carries no grammar text or the engine no grammar settings; run with tensor_parallel_size=1 in-process"
            )
        return {"session_id": self.session_id, "key": self.key, "worker_grammar": self.worker_grammar}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

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
            tracked = session.requests.get(self.key)
            if tracked is None:
                return  # the request already ended here (finished or aborted): its last logits do not matter
        elif self.worker_grammar is not None:
            # a worker process: the client then sees `stop` on a grammar error, which cannot travel back
            session, tracked = self._in_worker(len(sequence))
        else:
            raise RuntimeError(f"constrained request {self.key!r} is unknown to this process")
        stream = torch.cuda.ExternalStream(stream_ptr) if stream_ptr else _current_stream(logits)
        with _stream_context(stream):
            new_token = tracked.advance(sequence)
            if tracked.sync_error:
                force_end(beams[:1], session.end_id)
            else:  # a failed constraint still goes in: the post-processor masks it to EOS
                session.postprocessor([ConstrainedRow(tracked.constraint, 0, new_token)], beams[:1], stream)
            copy_mask_to_other_beams(beams)

    def _in_worker(self, prompt_len: int) -> tuple[ProcessorSession, TrackedConstraint]:
        worker = _worker_constraints(self.worker_grammar.settings)
        if self._worker_tracked is None:
            from llguidance import LLMatcher

            from llgtrt_core.constraints.grammar import GrammarConstraint

            grammar, settings = self.worker_grammar.grammar, self.worker_grammar.settings
            # built as the serving process's GrammarCompiler builds it, with the same settings
            matcher = LLMatcher(worker.tokenizer, grammar, log_level=settings.log_level, limits=worker.limits)
            self._worker_tracked = TrackedConstraint(GrammarConstraint(matcher, grammar), prompt_len)
        return worker.session, self._worker_tracked


def _current_stream(logits: torch.Tensor) -> Optional[torch.cuda.Stream]:
    return torch.cuda.current_stream(logits.device) if logits.is_cuda else None
