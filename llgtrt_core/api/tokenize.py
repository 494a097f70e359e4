"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt or chat messages to token ids
(rendered exactly as /chat/completions renders them), and token ids back to text."""

from __future__ import annotations

from llgtrt_core.api.errors import APIError
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


def tokenize(request: TokenizeRequest, runtime: ModelRuntime) -> TokenizeResponse:
    _check_model(request.model, runtime)
    tokenizer = runtime.tokenizer
    if isinstance(request, TokenizeChatRequest):
        text = chat_prompt_text(request, runtime, request_tool_plan(request, runtime))
    else:
        text = request.prompt
    tokens = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    token_strs = tokenizer.hf.convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=runtime.engine.max_model_len, tokens=tokens,
                            token_strs=token_strs)


def detokenize(request: DetokenizeRequest, runtime: ModelRuntime) -> DetokenizeResponse:
    _check_model(request.model, runtime)
    if any(not 0 <= t < runtime.tokenizer.vocab_size for t in request.tokens):
        raise APIError(f"token ids must be in [0, {runtime.tokenizer.vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=runtime.tokenizer.decode(request.tokens, skip_special_tokens=False))
