"""A request's thinking section (docs/reasoning.md): whether it has one, its budget, and the one
grammar of the thinking followed by the answer's own constraint.

The request says how much to think with `max_reasoning_tokens` (0: no thinking), chat's
`reasoning_effort` (Responses' `reasoning.effort`, Messages' `thinking`) or the template switch
`chat_template_kwargs.enable_thinking`; the prompt's end says whether the template opened the section
or already closed it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from llgtrt_core.api.errors import APIError
from llgtrt_core.constraints import RequestGrammar
from llgtrt_core.constraints.reasoning_grammar import reasoning_grammar
from llgtrt_core.reasoning import ReasoningSection, ReasoningSettings, prompt_state
from llgtrt_core.runtime import ModelRuntime

BUDGET_PARAM = "max_reasoning_tokens"
_EFFORT_SCALE = {"minimal": 0.25, "low": 0.25, "medium": 1.0, "high": 4.0}  # x the default budget
_PROMPT_TAIL_TOKENS = 32  # enough for the longest known marker (gpt-oss's, 8 tokens)


def thinking_off(request: Any) -> bool:
    """The request asks for no thinking at all (its template may then close the section itself)."""
    effort = getattr(request, "reasoning_effort", None)
    kwargs = getattr(request, "chat_template_kwargs", None) or {}
    return (getattr(request, "max_reasoning_tokens", None) == 0 or effort == "none"
            or kwargs.get("enable_thinking") is False)


def with_template_switch(request: Any) -> Any:
    """A chat request that asks for no thinking also tells its template (`enable_thinking: false`, Qwen3's
    switch), unless it set that itself."""
    kwargs = request.chat_template_kwargs or {}
    if not thinking_off(request) or "enable_thinking" in kwargs:
        return request
    return request.model_copy(update={"chat_template_kwargs": {**kwargs, "enable_thinking": False}})


def request_budget(request: Any, settings: Optional[ReasoningSettings]) -> Optional[int]:
    """The request's thinking budget; None when it has no thinking section (400s for what is wrong)."""
    wanted = getattr(request, "max_reasoning_tokens", None)
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None and effort != "none" and effort not in _EFFORT_SCALE:
        raise APIError(f"reasoning_effort must be one of none, {', '.join(_EFFORT_SCALE)}; got {effort!r}",
                       param="reasoning_effort")
    if thinking_off(request):
        return None
    if settings is None:
        if wanted is not None or effort is not None:
            param = BUDGET_PARAM if wanted is not None else "reasoning_effort"
            raise APIError("this model has no thinking section (set reasoning.start and reasoning.end in the config)",
                           param=param, code="unsupported_parameter")
        return None
    if wanted is None:
        scale = _EFFORT_SCALE.get(effort, 1.0) if effort is not None else 1.0
        return max(1, min(settings.max_budget, int(settings.default_budget * scale)))
    if wanted > settings.max_budget:
        raise APIError(f"max_reasoning_tokens must be at most {settings.max_budget}, got {wanted}", param=BUDGET_PARAM)
    return wanted


def request_section(request: Any, runtime: ModelRuntime, prompts: Sequence[Sequence[int]],
                    prompt_param: str) -> Optional[ReasoningSection]:
    """The thinking section of a request whose prompts are `prompts` (they must agree on whether they opened
    it); None: the answer comes at once."""
    settings = runtime.reasoning
    budget = request_budget(request, settings)
    if budget is None or settings is None:
        return None
    states = {prompt_state(settings, runtime.tokenizer.decode(list(p[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False))
              for p in prompts}
    if len(states) > 1:
        raise APIError("the prompts of one request must agree on whether they open the thinking section",
                       param=prompt_param)
    (opened,) = states
    return None if opened is None else ReasoningSection(settings, opened, budget)


def with_thinking(section: Optional[ReasoningSection], answer: Optional[RequestGrammar],
                  runtime: ModelRuntime) -> Optional[RequestGrammar]:
    """The grammar of the answer (the request's own, or the tools'; None: free text) with the
    thinking section before it."""
    if section is None:
        return answer
    settings = section.settings
    text = reasoning_grammar(None if section.opened_by_prompt else settings.start, settings.end, section.budget,
                             answer.grammar if answer is not None else None, runtime.tokenizer.hf.get_added_vocab())
    return RequestGrammar(answer.param if answer is not None else BUDGET_PARAM, text)
