"""From engine token deltas to per-choice text updates, for one request's choices at once.

Each choice is one engine request. Its token ids go through the incremental detokenizer, then the
stop-string matcher; a stop string ends the choice at once (closing the engine stream aborts the
engine request). Closing any of these iterators early, from a client disconnect for instance,
closes the engine streams beneath it, which frees their slots.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Literal, Optional, Sequence, TypeVar

import anyio

from llgtrt_core.api.errors import APIError
from llgtrt_core.constraints.errors import GrammarRequestError
from llgtrt_core.detokenizer import IncrementalDetokenizer
from llgtrt_core.engine.interface import (Engine, EngineError, EngineUnavailable, GenerationRequest, TokenDelta,
                                          TokenLogprob)
from llgtrt_core.stop_strings import StopStringMatcher
from llgtrt_core.tokenizer import Tokenizer
from llgtrt_core.tools.formats import ToolFormat
from llgtrt_core.tools.repeats import RepeatedCallStop

T = TypeVar("T")


class GenerationFailed(APIError):
    """The engine ended a request with an error (or aborted it on its own)."""

    def __init__(self, message: str):
        super().__init__(message, status_code=500)


def generation_failure(request: GenerationRequest, delta: TokenDelta) -> APIError:
    """A grammar that fails mid-generation (over llguidance's limits) is the request's doing: 400.
    Anything else that ends a request early is the server's: 500."""
    constraint = request.constraint
    if constraint is not None and constraint.error is not None:
        return APIError(f"the output constraint failed during generation: {constraint.error}", code="grammar_error",
                        param=getattr(constraint, "param", None))
    return GenerationFailed(delta.error or f"the engine ended the request ({delta.finish_reason})")


def engine_refusal(error: EngineError) -> APIError:
    """The request's fault (400), unless the engine can take no request at all (503)."""
    if isinstance(error, EngineUnavailable):
        return APIError(str(error), status_code=503)
    return APIError(str(error))


@dataclass(frozen=True)
class TextOptions:
    stop_strings: Sequence[str] = ()
    include_stop_string: bool = False
    skip_special_tokens: bool = True
    repeated_calls_stop: Optional[ToolFormat] = None  # end where the model repeats a tool call (tools/repeats.py)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 4x, once per streamed delta
class ChoiceUpdate:
    """One step of one choice. The last update of a choice carries its finish reason."""

    index: int
    text: str  # new text since the previous update of this choice (may be empty on the last)
    finish_reason: Optional[Literal["stop", "length"]]  # set on the last update only
    num_generated_tokens: int  # so far, for usage
    # Tokens since the previous update (those of held-back text wait for the next one), with
    # their logprobs when asked for; the first update carries the prompt's logprobs.
    token_ids: Sequence[int] = ()
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    cached_tokens: Optional[int] = None  # on the update with the engine's first tokens, when it says

    @property
    def is_acceptance(self) -> bool:
        """Only says the engine accepted the choice (its first delta brought nothing to hand out)."""
        return not self.text and self.finish_reason is None and not self.token_ids


async def close_quietly(iterator: AsyncIterator[object]) -> None:
    """Close an async iterator even inside a cancelled scope (a disconnect cancels the handler)."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


async def run_choice(
    engine: Engine, tokenizer: Tokenizer, index: int, request: GenerationRequest, options: TextOptions
) -> AsyncIterator[ChoiceUpdate]:
    """The choice's updates; the first one comes with the engine's first delta (an acceptance-only
    update when that delta brought nothing to hand out), so a caller can wait for acceptance."""
    detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, options.skip_special_tokens)
    matcher = StopStringMatcher(options.stop_strings, options.include_stop_string)
    repeats = RepeatedCallStop(options.repeated_calls_stop) if options.repeated_calls_stop is not None else None
    try:
        deltas: AsyncIterator[TokenDelta] = engine.generate(request)
    except EngineError as e:  # the engine refused the request (it checks what we could not)
        raise engine_refusal(e) from e
    num_generated = 0
    pending = _PendingTokens()
    accepted = False
    try:
        async for delta in deltas:
            if delta.finish_reason in ("error", "abort"):
                raise generation_failure(request, delta)
            num_generated += len(delta.token_ids)
            pending.add(delta)
            text = matcher.feed(detokenizer.add(delta.token_ids))
            if delta.finish_reason is not None and not matcher.stopped:
                text += matcher.feed(detokenizer.flush())
                text += matcher.flush()
            if repeats is not None:
                text = repeats.feed(text) + (repeats.flush() if delta.finish_reason is not None or matcher.stopped else "")
            if matcher.stopped or (repeats is not None and repeats.stopped):
                yield pending.update(index, text, "stop", num_generated)
                return
            if delta.finish_reason is not None:
                yield pending.update(index, text, delta.finish_reason, num_generated)
                return
            if text:
                yield pending.update(index, text, None, num_generated)
            elif not accepted:
                yield ChoiceUpdate(index, "", None, num_generated)
            accepted = True
        raise GenerationFailed("the engine stream ended without a finish reason")
    except EngineError as e:  # raised on the first step when generate() is an async generator
        raise engine_refusal(e) from e
    except GrammarRequestError as e:  # the engine compiles the constraint itself (its own process)
        raise APIError(str(e), param=e.param) from e
    finally:
        await close_quietly(deltas)


class _PendingTokens:
    """Tokens (and logprobs) not yet handed out in an update."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[TokenLogprob]] = None
        self.prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
        self.cached_tokens: Optional[int] = None

    def add(self, delta: TokenDelta) -> None:
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *delta.logprobs]
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.cached_tokens is not None:
            self.cached_tokens = delta.cached_tokens

    def update(self, index: int, text: str, finish_reason: Optional[Literal["stop", "length"]],
               num_generated: int) -> ChoiceUpdate:
        update = ChoiceUpdate(index, text, finish_reason, num_generated, self.token_ids, self.logprobs,
                              self.prompt_logprobs, self.cached_tokens)
        self.token_ids, self.logprobs, self.prompt_logprobs, self.cached_tokens = [], None, None, None
        return update


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: Optional[Literal["stop", "length"]] = None
    num_generated_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None


async def collect(updates: AsyncIterator[ChoiceUpdate], num_choices: int) -> list[ChoiceResult]:
    """Whole texts of every choice (the non-streamed response)."""
    results = [ChoiceResult() for _ in range(num_choices)]
    async for update in updates:
        result = results[update.index]
        result.text += update.text
        result.finish_reason = update.finish_reason
        result.num_generated_tokens = update.num_generated_tokens
        result.token_ids += update.token_ids
        if update.logprobs is not None:
            result.logprobs = result.logprobs or []
            result.logprobs += update.logprobs
        if update.prompt_logprobs is not None:
            result.prompt_logprobs = update.prompt_logprobs
    return results


def merge(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of all iterators as they come; closing the merge closes every iterator."""
    if len(iterators) == 1:  # the common case: no tasks, and no generator layer per item
        return iterators[0]
    return _merge_many(iterators)


async def _merge_many(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    pending = {asyncio.ensure_future(anext(it)): it for it in iterators}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                iterator = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterator))] = iterator
                yield item
    finally:
        with anyio.CancelScope(shield=True):
            for future in pending:
                future.cancel()
            # An iterator cannot be closed while its __anext__ task is still unwinding.
            with contextlib.suppress(BaseException):
                await asyncio.gather(*pending, return_exceptions=True)
            for iterator in iterators:
                await close_quietly(iterator)
