"""Request prompts to token ids: chat messages through the model's template, or legacy prompts.

Rendering and tokenizing take time proportional to the prompt (seconds for megabytes): they run in
a worker thread, so the event loop goes on serving every other stream and /livez meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional, Union

from llgtrt_core.api.errors import APIError
from llgtrt_core.api.protocol import (
    ChatCompletionContentPartRefusal,
    ChatCompletionContentPartText,
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
)
from llgtrt_core.chat_template import ChatTemplateError
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tokenizer import Tokenizer
from llgtrt_core.tools import ToolPlan, template_inputs


def _message_text(message: ChatCompletionMessageParam, param: str) -> str:
    """Content as one string (templates concatenate it); only text parts are supported."""
    if message.content is None:
        if message.role != "assistant":  # only an assistant turn (with tool calls) may omit it
            raise APIError(f"content is required for a {message.role} message", param=f"{param}.content")
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for i, part in enumerate(message.content):
        if isinstance(part, ChatCompletionContentPartText):
            texts.append(part.text)
        elif isinstance(part, ChatCompletionContentPartRefusal):
            texts.append(part.refusal)
        else:
            raise APIError(f"content parts of type {part.type!r} are not supported by this model; send text",
                           param=f"{param}.content[{i}]")
    return "\n".join(texts)


def _template_message(message: ChatCompletionMessageParam, param: str) -> dict[str, Any]:
    as_dict = message.model_dump(exclude_none=True)
    as_dict["content"] = _message_text(message, param)
    for call in as_dict.get("tool_calls", []):
        # Templates index into arguments as a mapping; the API sends a JSON string.
        try:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            pass
    return as_dict


async def chat_prompt_text(request: Union[ChatCompletionRequest, TokenizeChatRequest], runtime: ModelRuntime,
                           plan: Optional[ToolPlan]) -> str:
    """The conversation through the model's template, with the request's tools and template options."""
    return await asyncio.to_thread(_render, request, runtime, plan)


def _render(request: Union[ChatCompletionRequest, TokenizeChatRequest], runtime: ModelRuntime,
            plan: Optional[ToolPlan]) -> str:
    tokenizer = runtime.tokenizer
    if tokenizer.chat_template is None:
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    messages = [_template_message(m, f"messages[{i}]") for i, m in enumerate(request.messages)]
    messages, tools = template_inputs(messages, plan, runtime.tool_format)
    try:
        return tokenizer.chat_template.render(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=tools,
            extra_context=request.chat_template_kwargs,
        )
    except ChatTemplateError as e:
        raise APIError(str(e), param="messages") from e


async def chat_prompt_ids(request: ChatCompletionRequest, runtime: ModelRuntime,
                          plan: Optional[ToolPlan] = None) -> list[int]:
    def render_and_encode() -> list[int]:  # the template writes BOS and friends itself
        return runtime.tokenizer.encode(_render(request, runtime, plan), add_special_tokens=False)

    return await asyncio.to_thread(render_and_encode)


async def completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """One token-id list per prompt: str | [str] | [int] | [[int]]."""
    return await asyncio.to_thread(_completion_prompt_ids, request, tokenizer, vocab_size)


def _completion_prompt_ids(request: CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(p, str) for p in prompt)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompts = tokenizer.encode_many(texts, add_special_tokens=request.add_special_tokens)
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts or any(not ids for ids in prompts):
        raise APIError("prompt must not be empty", param="prompt")
    for ids in prompts:
        if any(not 0 <= t < vocab_size for t in ids):
            raise APIError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    return prompts
