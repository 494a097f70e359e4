"""The one engine interface: both engines (PyTorch, TensorRT-LLM) implement it, and the
serving layer and the constraint code only ever talk to it.

A request goes in as token ids plus sampling parameters and an optional constraint; token
deltas come out as an async stream. Constraints are applied by one engine-wide
`LogitsPostProcessor`, called once per engine step for every constrained row, so mask work
for the whole batch can run in parallel (llgtrt's design, TensorRT-LLM's batched processor).
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, AsyncIterator, Literal, Mapping, NamedTuple, Optional, Protocol, Sequence,
                    runtime_checkable)

import torch

from llgtrt_core.engine.dry import DryParams

if TYPE_CHECKING:
    from llgtrt_core.kernels.host_gate import GateTicket

FinishReason = Literal["stop", "length", "abort", "error"]
# Which distribution logprobs report: the model's own ("raw", before the constraint mask and every
# sampling control) or the one the token is drawn from ("processed"). docs/sampling.md.
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


@dataclass(frozen=True)
class LoopGuardSettings:
    """When a constrained answer's tail of tokens counts as a loop (constraints/loop_guard.py;
    config `llguidance.loop_guard`)."""

    min_span: int = 32  # the periodic tail covers at least this many tokens
    min_repeats: int = 3  # ... and at least this many periods
    # Steer to the nearest ending once the tokens left (of max_tokens) are this many (at most a
    # tenth of max_tokens) plus one per bracket open outside strings, so the document closes before
    # the length limit; max_tokens None: no limit known.
    closing_margin: int = 24
    max_tokens: Optional[int] = None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls, already validated by the serving layer.

    Applied in this order (docs/sampling.md): DRY, constraint mask, min_tokens, logit_bias, penalties,
    temperature, min_p, top_k, top_p, then the draw (argmax when greedy).
    """

    max_tokens: int
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # prompt or generated tokens: positive logits / it, negative ones * it
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # stop_token_ids are masked until this many tokens were generated
    seed: Optional[int] = None  # per-request generator: reproducible whatever the batch holds
    stop_token_ids: frozenset[int] = frozenset()  # EOS and friends; the token is not emitted
    logprobs: Optional[int] = None  # report each sampled token's logprob and this many alternatives
    prompt_logprobs: Optional[int] = None  # the same for every prompt token but the first
    logprobs_mode: LogprobsMode = "raw_logprobs"
    dry: Optional[DryParams] = None  # the DRY sampler (engine/dry.py), applied to the logits first
    # Constrained requests: the loop guard's settings (constraints/loop_guard.py); None: off. An engine
    # that rebuilds the constraint elsewhere (another process) gives it a guard with these.
    loop_guard: Optional[LoopGuardSettings] = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Constraint(Protocol):
    """Per-request constraint state (an llguidance matcher underneath).

    The engine never looks inside; it hands the object to its `LogitsPostProcessor` and reads
    `error` after each post-processing call to end a request whose grammar failed.
    """

    @property
    def error(self) -> Optional[str]: ...


class ConstrainedRow(NamedTuple):
    """One constrained sequence in this step's logits (a tuple: at batch 256 a step makes
    hundreds, and a frozen dataclass took 0.7 us each to build)."""

    constraint: Constraint
    row: int  # index into the step's logits
    new_token: Optional[int]  # token sampled for it last step (not yet committed); None at the first step


class LogitsPostProcessor(Protocol):
    """Masks this step's logits in place for every constrained row, in one batched call.

    `logits` is (batch, vocab) float; rows not listed must not be touched. Called on the
    engine's compute stream (`stream` is the CUDA stream to enqueue GPU work on, None on CPU).
    """

    def __call__(
        self,
        rows: Sequence[ConstrainedRow],
        logits: torch.Tensor,
        stream: Optional[torch.cuda.Stream] = None,
    ) -> None: ...


@runtime_checkable
class StagedPostProcessor(Protocol):
    """A post-processor in two halves, so an engine can overlap and fuse them: `fill` (commit the
    new tokens, compute the masks on the host; no logits needed, so it runs while the forward pass
    does) and `upload` (the masks and their logits rows on the device, ready for a kernel that
    masks while it samples). `__call__` stays fill, upload and mask in place, in one call.
    """

    def fill(self, rows: Sequence[ConstrainedRow], offset: int = 0) -> torch.Tensor:
        """Host (offset + len(rows), words) int32 masks, row offset + j for rows[j], the rows before
        `offset` an earlier fill's of the same step; valid until the next `fill` at offset 0."""
        ...

    def host_masks(self, count: int) -> torch.Tensor:
        """The first `count` rows of the buffer `fill` writes (what it returns once done)."""
        ...

    @property
    def capacity(self) -> int:
        """Rows the buffer holds without being replaced: while fills run, `host_masks` of at most
        this many rows stays theirs."""
        ...

    def upload(self, rows: Sequence[Optional[ConstrainedRow]], masks: torch.Tensor, device: torch.device,
               stream: Optional[torch.cuda.Stream] = None, gate: Optional[GateTicket] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(masks, int64 logits row indices; -1 for a row given as None, whose mask is skipped) on
        `device`, enqueued on `stream` on CUDA; with `gate`, the copy waits on the device for it."""
        ...


@runtime_checkable
class FastForwarder(Protocol):
    """A post-processor that can also hand out the tokens a grammar forces (fast-forward).

    An engine that can append several tokens to a sequence in one forward pass calls it right
    after sampling, instead of leaving the token for the next post-processor call to commit;
    an engine that cannot (TensorRT-LLM) never calls it and the post-processor commits as usual.
    """

    forwards_each_token: bool  # False: only at a request's start (token None); later tokens come through fills

    def commit_with_forced(self, constraint: Constraint, token: Optional[int], limit: int,
                           stop_token_ids: frozenset[int] = frozenset()) -> list[int]:
        """Commit `token` (None: nothing sampled yet), then the tokens the grammar forces after it,
        at most `limit` and up to the first stop token (left to be sampled, so the request ends as
        usual), and return those. The sequence's next `ConstrainedRow.new_token` is None. A rejected
        token sets `constraint.error` and forces nothing."""
        ...


@runtime_checkable
class ApartFiller(Protocol):
    """A post-processor that knows which constraints' masks are slow and can fill those rows apart
    from the step's batch (on another thread), so the batch's fill need not wait for them."""

    def split_apart(self, rows: list[ConstrainedRow]) -> tuple[list[ConstrainedRow], list[ConstrainedRow]]:
        """`rows` as (those to fill apart, the rest), asked every step."""
        ...

    def fill_apart(self, rows: Sequence[ConstrainedRow]) -> torch.Tensor:
        """`fill` for these rows into a (len(rows), words) host buffer of their own; never raises
        (a failed row gets its constraint's error and the EOS-only mask)."""
        ...

    def extend(self, masks: Optional[torch.Tensor], rows: Sequence[ConstrainedRow],
               more: Sequence[torch.Tensor]) -> torch.Tensor:
        """The step's host masks for `upload`: `masks` (this step's `fill`; None: none) then the rows
        of `more`, `rows`' masks in order."""
        ...


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    constraint: Optional[Constraint] = None


@dataclass(frozen=True)
class TokenLogprob:
    """Log probability of one token at one position, and the most likely tokens there."""

    logprob: float  # -inf for a token the distribution excludes
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request since the last delta; `finish_reason` is set on the last one."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None  # set when finish_reason == "error"
    # One per token id, when SamplingParams.logprobs is set (None from an engine without logprobs).
    logprobs: Optional[list[TokenLogprob]] = None
    # On the first delta when SamplingParams.prompt_logprobs is set: one per prompt token, None first.
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    # On the first delta with tokens (or the last), from an engine that knows: the prompt's leading
    # tokens whose KV came from its prefix cache, not computed (usage's cached_tokens).
    cached_tokens: Optional[int] = None

    def then(self, later: "TokenDelta") -> "TokenDelta":
        """This delta followed by `later`, as one: a consumer that fell behind takes its backlog in one
        chunk instead of paying the per-chunk cost (detokenize, serialize, send) once per token."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or ()), *(later.logprobs or ())]
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        cached_tokens = self.cached_tokens if self.cached_tokens is not None else later.cached_tokens
        return TokenDelta(self.token_ids + later.token_ids, later.finish_reason, later.error, logprobs,
                          prompt_logprobs, cached_tokens)


async def next_delta(deltas: asyncio.Queue) -> TokenDelta:
    """A request's next delta, with the backlog queued behind it merged in (`TokenDelta.then`)."""
    delta = await deltas.get()
    while delta.finish_reason is None and not deltas.empty():
        delta = delta.then(deltas.get_nowait())
    return delta


class EngineError(Exception):
    """A request the engine cannot take (bad prompt length, engine shut down)."""


class EngineUnavailable(EngineError):
    """The engine cannot take any request (its process is gone): the server's fault, not the request's."""


class Engine(abc.ABC):
    """Runs requests with continuous batching; every method is called from the event loop."""

    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary)
    max_model_len: int  # prompt + completion tokens one sequence may hold

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and start the step loop."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort everything in flight and release the device."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Submit a request; iterate its deltas. Closing the iterator early aborts the request."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """End a request now; its stream ends with finish_reason "abort"."""

    @property
    @abc.abstractmethod
    def num_active(self) -> int:
        """Requests submitted and not yet finished (running or waiting)."""

    @property
    def failure(self) -> Optional[str]:
        """Why the engine can serve nothing any more (its process died); None while it can."""
        return None

    async def stats(self) -> dict[str, object]:
        """Engine-specific counters for /v1/engine/stats (the embedded engine: its step phases)."""
        return {}
