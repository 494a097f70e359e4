"""A validated API request to engine requests: one per prompt and choice.

Everything the client got wrong is found here, before any engine work, and reported as a 400
naming the parameter: unsupported parameters, prompts longer than the context, bad token ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any, AsyncIterator, Optional, Union

from llgtrt_core.api.errors import APIError
from llgtrt_core.api.field_limits import check_request_size
from llgtrt_core.api.generation import ChoiceUpdate, TextOptions, merge, run_choice
from llgtrt_core.api.limits import admit
from llgtrt_core.api.protocol import ChatCompletionRequest, CompletionRequest
from llgtrt_core.constraints.errors import GrammarRequestError
from llgtrt_core.constraints.request_grammar import RequestGrammar, asks_for_grammar
from llgtrt_core.engine.dry import DryParams, breaker_token_ids
from llgtrt_core.engine.interface import Constraint, GenerationRequest, SamplingParams
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tools.formats import ToolFormat

ApiRequest = Union[ChatCompletionRequest, CompletionRequest]

_SEED_MODULUS = 2**63  # choice seeds stay in int64 range


def check_request(request: ApiRequest, runtime: ModelRuntime) -> None:
    """What can be refused before any tokenization: an unknown model (404), unsupported parameters,
    a request past the per-request bounds."""
    if request.model is not None and request.model != runtime.model_name:
        raise APIError(f"The model `{request.model}` does not exist.", status_code=404, param="model",
                       code="model_not_found")
    unsupported = request.unsupported_params()
    if unsupported:
        names = ", ".join(unsupported)
        raise APIError(f"unsupported parameter(s): {names} (not implemented by this server)",
                       param=unsupported[0], code="unsupported_parameter")
    check_request_size(request, runtime.limits)


async def build_request_grammar(request: ApiRequest, runtime: ModelRuntime) -> Optional[RequestGrammar]:
    """The grammar the request's own fields ask for (None: free text), built once per request, on a
    worker thread when there is one to build: a schema of megabytes takes seconds to copy and write."""
    try:
        if not asks_for_grammar(request):
            return None
        return await asyncio.to_thread(runtime.grammars.request_grammar, request)
    except GrammarRequestError as e:  # a malformed schema or constraint field
        raise APIError(str(e), param=e.param) from e


async def make_constraint(request: ApiRequest, runtime: ModelRuntime, grammar: Optional[RequestGrammar],
                          max_tokens: Optional[int] = None) -> Optional[Constraint]:
    """The one place requests meet the grammar compiler: a fresh constraint of `grammar` (the
    request's own, or what replaces it: tools, a thinking section) for every choice of at most
    `max_tokens`; None when there is no grammar."""
    if grammar is None:
        return None
    try:
        return await runtime.grammars.constraint(grammar.grammar, grammar.param,
                                                 runtime.grammars.loop_guard_for(request, max_tokens))
    except GrammarRequestError as e:  # bad schema / grammar: llguidance says what is wrong
        raise APIError(str(e), param=e.param) from e


def _max_tokens(request: ApiRequest, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    room = max_model_len - prompt_len
    if room <= 0:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens, leaving no room for the completion.",
            param=prompt_param, code="context_length_exceeded")
    wanted = request.max_new_tokens
    if wanted is None:
        return room
    if wanted > room:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} for the completion). "
            f"Reduce the prompt or the completion length.",
            param=_max_tokens_param(request), code="context_length_exceeded")
    return wanted


def _max_tokens_param(request: ApiRequest) -> str:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def _stop_token_ids(request: ApiRequest, runtime: ModelRuntime) -> frozenset[int]:
    extra = request.stop_token_ids or []
    if any(not 0 <= t < runtime.engine.vocab_size for t in extra):
        raise APIError(f"stop_token_ids must be in [0, {runtime.engine.vocab_size})", param="stop_token_ids")
    eos = frozenset() if request.ignore_eos else runtime.tokenizer.eos_token_ids
    return eos | frozenset(extra)


def _logit_bias(request: ApiRequest, vocab_size: int) -> dict[int, float]:
    bias = request.token_logit_bias
    if any(t >= vocab_size for t in bias):
        raise APIError(f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
    return bias


def _min_tokens(request: ApiRequest, max_tokens: int) -> int:
    if request.min_tokens > max_tokens:
        raise APIError(f"min_tokens ({request.min_tokens}) must not exceed the completion's max_tokens ({max_tokens})",
                       param="min_tokens")
    return request.min_tokens


def _dry(request: ApiRequest, runtime: ModelRuntime) -> Optional[DryParams]:
    if request.dry_multiplier == 0.0 or request.dry_penalty_last_n == 0:
        return None
    breakers = _breaker_ids(runtime.grammars.tokenizer, tuple(request.dry_sequence_breakers))
    return DryParams(request.dry_multiplier, request.dry_base, request.dry_allowed_length,
                     request.dry_penalty_last_n, breakers)


@functools.lru_cache(maxsize=16)
def _breaker_ids(ll_tokenizer: Any, breakers: tuple[str, ...]) -> frozenset[int]:
    """Per tokenizer and breaker list (the default one nearly always): a scan of the vocabulary."""
    texts = [ll_tokenizer.decode_bytes([t]).decode("utf-8", errors="replace") for t in range(ll_tokenizer.vocab_size)]
    return breaker_token_ids(texts, breakers)


def _text_options(request: ApiRequest, repeated_calls_stop: Optional[ToolFormat]) -> TextOptions:
    return TextOptions(request.stop_strings, request.include_stop_str_in_output, request.skip_special_tokens,
                       repeated_calls_stop)


async def _engine_requests(request: ApiRequest, runtime: ModelRuntime, prompts: list[list[int]],
                    request_id: str, grammar: Optional[RequestGrammar] = None) -> list[GenerationRequest]:
    """Candidate i of prompt p gets index p * num_candidates + i, and seed + index so seeded
    candidates differ (num_candidates is best_of, or n)."""
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    stop_token_ids = _stop_token_ids(request, runtime)
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    logit_bias = _logit_bias(request, runtime.engine.vocab_size)
    num_logprobs = request.num_logprobs
    if num_logprobs is None and request.num_candidates > request.n:
        num_logprobs = 0  # best_of ranks candidates by their logprobs
    # Completions with echo score the prompt too (the legacy logprobs start with the echoed prompt).
    prompt_logprobs = request.num_logprobs if isinstance(request, CompletionRequest) and request.echo else None
    dry = _dry(request, runtime)
    planned = []
    for prompt_index, prompt_ids in enumerate(prompts):
        max_tokens = _max_tokens(request, len(prompt_ids), runtime.engine.max_model_len, prompt_param)
        for choice in range(request.num_candidates):
            index = prompt_index * request.num_candidates + choice
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=top_k,
                min_p=request.min_p or 0.0,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                logit_bias=logit_bias,
                min_tokens=_min_tokens(request, max_tokens),
                seed=None if request.seed is None else (request.seed + index) % _SEED_MODULUS,
                stop_token_ids=stop_token_ids,
                logprobs=num_logprobs,
                prompt_logprobs=prompt_logprobs,
                logprobs_mode=request.logprobs_mode,
                dry=dry,
            )
            constraint = await make_constraint(request, runtime, grammar, max_tokens)
            if constraint is not None:
                sampling = dataclasses.replace(sampling, loop_guard=runtime.grammars.loop_guard_for(request, max_tokens))
            planned.append(GenerationRequest(f"{request_id}-{index}", prompt_ids, sampling, constraint))
    return planned


async def start_choices(request: ApiRequest, runtime: ModelRuntime, prompts: list[list[int]], request_id: str,
                        grammar: Optional[RequestGrammar] = None, repeated_calls_stop: Optional[ToolFormat] = None
                        ) -> tuple[list[GenerationRequest], AsyncIterator[ChoiceUpdate]]:
    """Take the request's admission places, plan every choice and return their merged updates
    (nothing runs until iterated). `repeated_calls_stop`: the tool format whose calls end a choice
    when one repeats."""
    await admit(len(prompts) * request.num_candidates)
    planned = await _engine_requests(request, runtime, prompts, request_id, grammar)
    options = _text_options(request, repeated_calls_stop)
    choices = [run_choice(runtime.engine, runtime.tokenizer, i, r, options) for i, r in enumerate(planned)]
    return planned, merge(choices)
