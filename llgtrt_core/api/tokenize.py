"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt or chat messages to token ids
(rendered exactly as /chat/completions renders them), and token ids back to text."""

from __future__ import annotations

import asyncio

from llgtrt_core.api.errors import APIError
from llgtrt_core.api.field_limits import check_request_size
from llgtrt_core.api.prompts import chat_prompt_text
from llgtrt_core.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from llgtrt_core.api.tool_calls import request_tool_plan
from llgtrt_core.runtime import ModelRuntime


def _check_model(model: str | None, runtime: ModelRuntime) -> None:
    if model is not None and model != runtime.model_name:
        raise APIError(f"The model `{model}` does not exist.", status_code=404, param="model", code="model_not_found")


async def tokenize(request: TokenizeRequest, runtime: ModelRuntime) -> TokenizeResponse:
    _check_model(request.model, runtime)
    check_request_size(request, runtime.limits)
    tokenizer = runtime.tokenizer
    if isinstance(request, TokenizeChatRequest):
        text = await chat_prompt_text(request, runtime, request_tool_plan(request, runtime))
    else:
        text = request.prompt

    def encode() -> tuple[list[int], list[str] | None]:  # off the event loop: megabytes take seconds
        tokens = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return tokens, tokenizer.hf.convert_ids_to_tokens(tokens) if request.return_token_strs else None

    tokens, token_strs = await asyncio.to_thread(encode)
    return TokenizeResponse(count=len(tokens), max_model_len=runtime.engine.max_model_len, tokens=tokens,
                            token_strs=token_strs)


async def detokenize(request: DetokenizeRequest, runtime: ModelRuntime) -> DetokenizeResponse:
    _check_model(request.model, runtime)
    if any(not 0 <= t < runtime.tokenizer.vocab_size for t in request.tokens):
        raise APIError(f"token ids must be in [0, {runtime.tokenizer.vocab_size})", param="tokens")
    text = await asyncio.to_thread(runtime.tokenizer.decode, request.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text)
