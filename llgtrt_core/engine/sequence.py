"""A request's state inside the embedded engine, and the plan of one engine step (host only)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from llgtrt_core.engine.block_manager import PrefixHit
from llgtrt_core.engine.interface import FinishReason, GenerationRequest, TokenDelta, TokenLogprob


@dataclass
class Sequence:
    request: GenerationRequest
    emit: Callable[[TokenDelta], None]  # engine thread: queues the delta for the step's delivery
    generator: object  # its torch.Generator (the sampler's per-row draws)
    length: int = 0  # positions held in the KV cache
    token_ids: list[int] = field(default_factory=list)  # prompt + emitted tokens, once admitted
    prefill_tokens: list[int] = field(default_factory=list)  # prompt + forced (or emitted) tokens, until prefilled
    admission: int = -1  # when it was last admitted: preemption takes the newest
    num_generated: int = 0
    pending_tokens: list[int] = field(default_factory=list)  # sampled (then forced) tokens not in the cache yet
    uncommitted_token: Optional[int] = None  # sampled last step, not yet seen by the constraint
    fast_forward: bool = False  # its constraint's forced tokens are fed without sampling
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # sent with the first delta
    cached_tokens: Optional[int] = None  # prompt positions its first prefill reused; sent with the first delta
    prefix: Optional[PrefixHit] = None  # its cached prefix, looked up to decide its admission
    arrival: float = field(default_factory=time.monotonic)  # for the queue-time metric

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def delta(self, token_ids: list[int], finish_reason: Optional[FinishReason] = None, error: Optional[str] = None,
              logprobs: Optional[list[TokenLogprob]] = None) -> TokenDelta:
        """A delta with these tokens; the first one also carries the prompt logprobs and cached tokens."""
        delta = TokenDelta(token_ids, finish_reason, error, logprobs, self.prompt_logprobs, self.cached_tokens)
        self.prompt_logprobs = self.cached_tokens = None
        return delta

    def scores_prompt(self) -> bool:
        """Prompt logprobs were asked for and are not sent yet."""
        return self.prompt_logprobs is not None


@dataclass(frozen=True)
class Chunk:
    """Prompt positions seq.length..end-1 prefilled into cache row `row` this step."""

    seq: Sequence
    row: int
    end: int
    last: bool  # the prompt is prefilled to its end: the sequence samples this step

    @property
    def num_tokens(self) -> int:
        return self.end - self.seq.length


@dataclass(frozen=True)
class StepPlan:
    """What one forward pass computes: a token for each of the first `num_decoding` running rows
    (0..n-1), then the prompt chunks. The rows that sample are the running ones after the plan (the
    chunks that end their prompt joined them, in row order)."""

    num_decoding: int
    chunks: list[Chunk]
