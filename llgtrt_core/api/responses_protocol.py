"""Pydantic models of OpenAI's Responses API (POST /v1/responses), field by field.

Shapes follow the official `openai` client's types (`openai.types.responses`). Like the chat models,
unknown request fields are refused, and known fields this server does not implement are listed by
`unsupported_params()` so they are refused by name. Items and tools of kinds this server cannot serve
(images, hosted tools such as web_search) are parsed as `Unsupported` and refused with a
400 naming them, rather than failing validation with a union error.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from typing_extensions import Annotated

from llgtrt_core.api.protocol import OpenAIBaseModel, OpenAIResponseModel, ParamError, TopLogprob, now

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _kind(value: Any, known: tuple[str, ...], default: Optional[str] = None) -> str:
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
    return kind if kind in known else "other"


# --------------------------------------------------------------------------- input items


class InputText(OpenAIBaseModel):
    type: Literal["input_text"]
    text: str


class OutputText(OpenAIBaseModel):
    """Assistant text, as a previous response returned it (sent back in `input`)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: Optional[list[dict[str, Any]]] = None


class Refusal(OpenAIBaseModel):
    type: Literal["refusal"]
    refusal: str


class Unsupported(BaseModel):
    """Any input part, item, tool or tool choice of a type this server does not serve (images, files,
    audio; item references; hosted tools such as web_search; allowed_tools, mcp):
    parsed only so that the 400 can name it and its type."""

    model_config = ConfigDict(extra="allow")
    type: str


ContentPart = Annotated[
    Union[Annotated[InputText, Tag("input_text")], Annotated[OutputText, Tag("output_text")],
          Annotated[Refusal, Tag("refusal")], Annotated[Unsupported, Tag("other")]],
    Discriminator(lambda v: _kind(v, ("input_text", "output_text", "refusal"))),
]


class MessageItem(OpenAIBaseModel):
    """EasyInputMessage, Message and ResponseOutputMessage alike (`type` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    namespace: Optional[str] = None


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ReasoningItem(OpenAIBaseModel):
    """A reasoning output item sent back as input: accepted, and left out of the prompt (docs/reasoning.md)."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[Any] = Field(default_factory=list)
    content: Optional[list[Any]] = None
    encrypted_content: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")],
          Annotated[Unsupported, Tag("other")]],
    Discriminator(lambda v: _kind(v, ("message", "function_call", "function_call_output", "reasoning"),
                                  default="message")),
]


# --------------------------------------------------------------------------- tools, text format


class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None


Tool = Annotated[
    Union[Annotated[FunctionTool, Tag("function")], Annotated[Unsupported, Tag("other")]],
    Discriminator(lambda v: _kind(v, ("function",))),
]


class ToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: str


ToolChoice = Union[
    Literal["none", "auto", "required"],
    Annotated[Union[Annotated[ToolChoiceFunction, Tag("function")], Annotated[Unsupported, Tag("other")]],
              Discriminator(lambda v: _kind(v, ("function",)))],
]


class TextFormatText(OpenAIBaseModel):
    type: Literal["text"]


class TextFormatJsonObject(OpenAIBaseModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(OpenAIBaseModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


TextFormat = Annotated[Union[TextFormatText, TextFormatJsonObject, TextFormatJsonSchema], Field(discriminator="type")]


class TextConfig(OpenAIBaseModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ReasoningConfig(OpenAIBaseModel):
    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class ResponsesStreamOptions(OpenAIBaseModel):
    include_obfuscation: bool = False  # we never pad deltas, so there is nothing to obfuscate


# --------------------------------------------------------------------------- request


class ResponsesRequest(OpenAIBaseModel):
    model: Optional[str] = None  # None: the served model
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    text: Optional[TextConfig] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    max_tool_calls: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    include: Optional[list[str]] = None
    stream: bool = False
    stream_options: Optional[ResponsesStreamOptions] = None
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    reasoning: Optional[ReasoningConfig] = None
    background: Optional[bool] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    prompt: Optional[dict[str, Any]] = None
    context_management: Optional[list[dict[str, Any]]] = None
    # Bookkeeping fields that do not change the output.
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def unsupported_params(self) -> list[str]:
        in_use = {
            "background": bool(self.background),
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "context_management": bool(self.context_management),
            "max_tool_calls": self.max_tool_calls is not None,
            "truncation": self.truncation == "auto",  # we never drop input to make room
            "reasoning.summary": self.reasoning is not None and self.reasoning.summary is not None,
            "text.verbosity": self.text is not None and self.text.verbosity is not None,
        }
        return [name for name, used in in_use.items() if used]


# --------------------------------------------------------------------------- response


class OutputTextLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputTextPart(OpenAIResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputTextLogprob] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(OpenAIResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputTextPart] = Field(default_factory=list)


class OutputFunctionCall(OpenAIResponseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


class ReasoningText(OpenAIResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputReasoning(OpenAIResponseModel):
    """A reasoning model's thinking (docs/reasoning.md), before the message or calls it led to."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


OutputItem = Union[OutputReasoning, OutputMessage, OutputFunctionCall]


class InputTokensDetails(OpenAIResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: Optional[int] = None) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens or 0))


class ResponseError(OpenAIResponseModel):
    code: str
    message: str


class IncompleteDetails(OpenAIResponseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponseObject(OpenAIResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    completed_at: Optional[int] = None
    status: ResponseStatus = "in_progress"
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    model: str
    instructions: Optional[str] = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = None
    max_output_tokens: Optional[int] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    background: bool = False
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: Optional[dict[str, Any]] = None
    service_tier: str = "default"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: Optional[str] = None
    usage: Optional[ResponseUsage] = None


class ResponseDeleted(OpenAIResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
