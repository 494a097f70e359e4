"""Renders a model's own Jinja chat template in a sandbox.

Templates come with downloaded checkpoints, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` (no attribute access to internals, no mutation of inputs) with
only the helpers Hugging Face templates rely on (`raise_exception`, `tojson`, `strftime_now`,
`{% generation %}` blocks).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation or failed to render (a client error)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; HF templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template plus the special tokens templates refer to by name."""

    def __init__(self, source: str, special_tokens: dict[str, Optional[str]]):
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        self.source = source
        self._special_tokens = special_tokens  # bos_token, eos_token, ...

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict[str, Any]]] = None,
        documents: Optional[list[dict[str, Any]]] = None,
        extra_context: Optional[dict[str, Any]] = None,
    ) -> str:
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
        context = {
            **self._special_tokens,
            **(extra_context or {}),
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            rendered = self._template.render(context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # undefined names, sandbox violations, ...
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e!r}") from e
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages)
        return rendered


def _cut_after_final_message(rendered: str, messages: list[dict[str, Any]]) -> str:
    """Drop what the template appends after the last message (end-of-turn tokens), as HF does."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text content")
    final = final.strip()
    at = rendered.rfind(final)
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message does not appear in the rendered chat")
    return rendered[: at + len(final)]
