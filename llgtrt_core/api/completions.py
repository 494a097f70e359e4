"""POST /v1/completions (legacy text completions)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from llgtrt_core.api.errors import APIError
from llgtrt_core.api.generation import ChoiceResult, close_quietly
from llgtrt_core.api.logprobs import CompletionLogprobsBuilder, mean_logprob, token_texts
from llgtrt_core.api.prompts import completion_prompt_ids
from llgtrt_core.api.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionLogprobs,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
    now,
    random_id,
)
from llgtrt_core.api.reasoning import request_section, with_thinking
from llgtrt_core.api.sampling import build_request_grammar, check_request
from llgtrt_core.api.serving import DoneTerminatedWriter, Generation, completion_tokens, serve, start_generation
from llgtrt_core.api.streaming import TEXT_PLACEHOLDER, TextEvents, sse_event
from llgtrt_core.constraints.request_grammar import RequestGrammar
from llgtrt_core.engine.interface import TokenLogprob
from llgtrt_core.runtime import ModelRuntime


async def _prompts(request: CompletionRequest, runtime: ModelRuntime
                   ) -> tuple[list[list[int]], Optional[RequestGrammar]]:
    """The prompts, and the request's grammar (None: free text), with a thinking section before the
    answer when there is one. The text comes back whole, thinking and markers included
    (docs/reasoning.md)."""
    check_request(request, runtime)
    prompts = await completion_prompt_ids(request, runtime.tokenizer, runtime.tokenizer.vocab_size)
    section = request_section(request, runtime, prompts, "prompt")
    return prompts, with_thinking(section, await build_request_grammar(request, runtime), runtime)


async def completion_text(request: CompletionRequest, runtime: ModelRuntime) -> AsyncIterator[str]:
    """The generated text as it comes, choices interleaved (bentoml's own `generate` API).

    Bad requests, and requests the engine refuses, raise APIError before the first piece.
    """
    if request.num_candidates > request.n:  # choosing the best needs whole candidates
        raise APIError("best_of greater than n is not available here; use /v1/completions", param="best_of")
    prompts, grammar = await _prompts(request, runtime)
    generation = await start_generation(request, runtime, prompts, random_id("cmpl"), grammar)
    try:
        async for update in generation.updates:
            if update.text:
                yield update.text
    finally:
        await close_quietly(generation.updates)


class _ChoiceText:
    """One choice's text and logprobs, piece by piece; the first piece echoes the prompt when asked."""

    def __init__(self, request: CompletionRequest, runtime: ModelRuntime, prompt_ids: list[int]):
        self._echo_ids = prompt_ids if request.echo else None
        self._tokenizer = runtime.tokenizer
        asked = request.logprobs is not None
        self._logprobs = CompletionLogprobsBuilder(token_texts(runtime)) if asked else None

    def piece(self, text: str, token_ids: list[int], logprobs: Optional[list[TokenLogprob]],
              prompt_logprobs: Optional[list[Optional[TokenLogprob]]]) -> tuple[str, Optional[CompletionLogprobs]]:
        scored: list[Optional[TokenLogprob]] = list(logprobs or [])
        if self._echo_ids is not None:
            text = self._tokenizer.decode(self._echo_ids) + text
            token_ids = self._echo_ids + token_ids
            scored = list(prompt_logprobs or [None] * len(self._echo_ids)) + scored
            self._echo_ids = None
        if self._logprobs is None or logprobs is None:  # not asked for, or an engine without logprobs
            return text, None
        return text, self._logprobs.add(token_ids, scored)


def _best_candidates(results: list[ChoiceResult], request: CompletionRequest) -> list[tuple[int, ChoiceResult]]:
    """(prompt index, result) of the returned choices: of each prompt's best_of candidates, the n
    with the highest logprob per token (all of them, in order, without best_of)."""
    chosen = []
    per_prompt = request.num_candidates
    for start in range(0, len(results), per_prompt):
        candidates = results[start: start + per_prompt]
        if per_prompt > request.n:
            candidates = sorted(candidates, key=lambda r: mean_logprob(r.logprobs), reverse=True)[: request.n]
        chosen += [(start // per_prompt, r) for r in candidates]
    return chosen


async def create_completion(request: CompletionRequest, runtime: ModelRuntime, raw_request: Request) -> Response:
    prompts, grammar = await _prompts(request, runtime)
    return await serve(raw_request, runtime, request, prompts, random_id("cmpl"), _CompletionWriter(request, runtime),
                       stream=request.stream, grammar=grammar)


class _CompletionWriter(DoneTerminatedWriter):
    def __init__(self, request: CompletionRequest, runtime: ModelRuntime):
        self.request = request
        self.runtime = runtime

    def body(self, generation: Generation, results: list[ChoiceResult]) -> dict[str, Any]:
        choices = []
        for index, (prompt_index, result) in enumerate(_best_candidates(results, self.request)):
            text, logprobs = _ChoiceText(self.request, self.runtime, generation.prompts[prompt_index]).piece(
                result.text, result.token_ids, result.logprobs, result.prompt_logprobs)
            choices.append(CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                                    finish_reason=result.finish_reason))
        return CompletionResponse(id=generation.response_id, model=self.runtime.model_name, choices=choices,
                                  usage=UsageInfo.of(generation.prompt_tokens, completion_tokens(results),
                                                     generation.cached_tokens)
                                  ).model_dump()

    def events(self, generation: Generation) -> AsyncIterator[str]:
        options = self.request.stream_options
        include_usage = options is not None and options.include_usage
        return _stream(generation, self.request, self.runtime, include_usage)


async def _stream(generation: Generation, request: CompletionRequest, runtime: ModelRuntime,
                  include_usage: bool) -> AsyncIterator[str]:
    """Streamed choices (best_of == n here): prompt p serves choices p*n .. p*n+n-1."""
    updates, response_id, prompts = generation.updates, generation.response_id, generation.prompts
    created = now()

    def chunk(choices: list[CompletionResponseChoice], usage: Optional[UsageInfo] = None) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=response_id, created=created, model=runtime.model_name, choices=choices,
                                        usage=usage)

    choice_texts = [_ChoiceText(request, runtime, prompt) for prompt in prompts for _ in range(request.n)]
    # Most chunks are plain text (no logprobs or finish reason): each choice's from a template.
    text_events = [TextEvents(chunk([CompletionResponseChoice(index=index, text=TEXT_PLACEHOLDER)]))
                   for index in range(len(choice_texts))]
    completion_tokens = [0] * len(choice_texts)
    try:
        async for update in updates:
            completion_tokens[update.index] = update.num_generated_tokens
            text, logprobs = choice_texts[update.index].piece(update.text, list(update.token_ids), update.logprobs,
                                                              update.prompt_logprobs)
            if logprobs is None and update.finish_reason is None:
                yield text_events[update.index](text)
            else:
                yield sse_event(chunk([CompletionResponseChoice(index=update.index, text=text, logprobs=logprobs,
                                                                finish_reason=update.finish_reason)]))
        if include_usage:
            yield sse_event(chunk([], UsageInfo.of(generation.prompt_tokens, sum(completion_tokens),
                                                   generation.cached_tokens)))
    finally:
        await close_quietly(updates)
