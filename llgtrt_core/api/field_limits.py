"""Per-request bounds on the work a request asks for, checked before any of it starts (400 naming
the field): sequences (prompts x choices), prompt characters, messages and tools (config `server.*`)."""

from __future__ import annotations

from typing import Any, Optional

from llgtrt_core.api.errors import APIError
from llgtrt_core.config import ServerConfig


def check_request_size(request: Any, limits: ServerConfig) -> None:
    """For chat, completion and tokenize requests alike (fields a request lacks are not checked)."""
    prompt = getattr(request, "prompt", None)
    messages: Optional[list[Any]] = getattr(request, "messages", None)
    if hasattr(request, "num_candidates"):
        _check_sequences(request, _num_prompts(prompt) if messages is None else 1, limits.max_sequences_per_request)
    if messages is not None:
        _at_most(len(messages), limits.max_messages, "messages", "messages")
        _at_most(sum(_content_chars(m.content) for m in messages), limits.max_prompt_chars, "messages",
                 "characters of message content")
    elif prompt is not None:
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        _at_most(sum(len(t) for t in texts), limits.max_prompt_chars, "prompt", "prompt characters")
    for field in ("tools", "functions"):
        _at_most(len(getattr(request, field, None) or ()), limits.max_tools, field, field)


def _num_prompts(prompt: Any) -> int:
    """str and [int] are one prompt; [str] and [[int]] one per item."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def _check_sequences(request: Any, num_prompts: int, limit: int) -> None:
    sequences = num_prompts * request.num_candidates
    if limit and sequences > limit:
        param = "best_of" if request.num_candidates > request.n else "n"
        raise APIError(f"the request asks for {sequences} sequences ({num_prompts} prompt(s) x {param} "
                       f"{request.num_candidates}); at most {limit} are allowed per request: send fewer prompts "
                       f"or a smaller {param}", param=param)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(getattr(part, "text", None) or getattr(part, "refusal", None) or "") for part in content or ())


def _at_most(count: int, limit: int, param: str, what: str) -> None:
    if limit and count > limit:
        raise APIError(f"{param}: {count} {what}, more than the {limit} allowed per request", param=param)
