"""What the serving process and the engine process say to each other (core_client.py, core_process.py).

Messages are tuples pickled over a connection (multiprocessing.connection framing): the socket
pair between the engine process and the API worker that started it, and with several API workers
one Unix socket connection per other worker; a message's first item names it. Serving -> engine:
    ("add", request_id, prompt_token_ids, SamplingParams, grammar text or None)
    ("abort", request_id)
    ("precompile", grammar text)       the serving process started compiling it too (a tools grammar, to name a
                                       failing tool; first sight)
    ("stats", token)
    ("stop",)                          the owner only; the others just close
Engine -> serving:
    ("ready", vocab_size, max_model_len) or ("failed", message)   once, after the spec (owner) or on connecting
    ("accepted", request_id)           before any delta of the request
    ("rejected", request_id, kind, message)   kind "engine" (EngineError) or "grammar" (a 400 naming the
                                       request field the grammar came from)
    ("deltas", [DeltaRow, ...])        one message per engine step
    ("stats", token, dict)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from llgtrt_core.config import LlguidanceConfig
from llgtrt_core.engine.interface import TokenDelta, TokenLogprob

# (request_id, token_ids, finish_reason, error, logprobs, prompt_logprobs, cached_tokens, grammar_error):
# a TokenDelta as a plain tuple, which pickles several times faster than the dataclass.
DeltaRow = tuple[str, list[int], Optional[str], Optional[str], Optional[list[TokenLogprob]],
                 Optional[list[Optional[TokenLogprob]]], Optional[int], bool]


@dataclass(frozen=True)
class CoreSpec:
    """Everything the engine process needs to build the engine and its constraint stage."""

    model_dir: str
    engine_config: object  # TorchEngineConfig (kept untyped here: importing it imports torch)
    vocab_size: int  # the logits width, which llguidance's masks match
    eos_token_ids: tuple[int, ...]
    llguidance: LlguidanceConfig = field(default_factory=LlguidanceConfig)
    listen_path: Optional[str] = None  # a Unix socket the other API workers connect to (several workers)


def delta_row(request_id: str, delta: TokenDelta, grammar_error: bool) -> DeltaRow:
    return (request_id, delta.token_ids, delta.finish_reason, delta.error, delta.logprobs, delta.prompt_logprobs,
            delta.cached_tokens, grammar_error)


def row_delta(row: DeltaRow) -> TokenDelta:
    _, token_ids, finish_reason, error, logprobs, prompt_logprobs, cached_tokens, _ = row
    return TokenDelta(token_ids, finish_reason, error, logprobs, prompt_logprobs,  # type: ignore[arg-type]
                      cached_tokens)
