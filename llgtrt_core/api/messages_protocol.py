"""Pydantic models of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), field
by field as the official `anthropic` client sends and reads them. Unknown fields are refused; block
types this server cannot serve (images, documents, server tools) parse as `UnsupportedBlock` and are
refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from llgtrt_core.api.protocol import OpenAIBaseModel, OpenAIResponseModel

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
               503: "overloaded_error", 529: "overloaded_error"}
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class CacheControlled(OpenAIBaseModel):
    cache_control: Optional[dict[str, Any]] = None  # prompt caching hints: accepted, nothing to do


class TextBlock(CacheControlled):
    type: Literal["text"]
    text: str
    citations: Optional[list[Any]] = None


class ToolUseBlock(CacheControlled):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(CacheControlled):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Optional[Union[str, list[TextBlock]]] = None
    is_error: Optional[bool] = None


class ThinkingBlock(OpenAIBaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(OpenAIBaseModel):
    type: Literal["redacted_thinking"]
    data: str


class UnsupportedBlock(BaseModel):
    """A block type this server does not serve (image, document, server tool results, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking") else "other"


ContentBlock = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                               Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
                               Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
                               Annotated[UnsupportedBlock, Tag("other")]], Discriminator(_block_tag)]


class MessageParam(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(CacheControlled):
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    strict: Optional[bool] = None


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class ThinkingConfig(OpenAIBaseModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = Field(default=None, ge=1)
    display: Optional[str] = None


class JsonOutputFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBaseModel):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None  # -> the thinking budget
    format: Optional[JsonOutputFormat] = None  # structured output: the answer follows the schema


class CountTokensRequest(OpenAIBaseModel):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Optional[Union[str, list[TextBlock]]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[dict[str, Any]] = None  # prompt caching hints: accepted, nothing to do


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = Field(default=None, max_length=4)  # our chat's bound on stop strings
    stream: bool = False
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    # Bookkeeping fields that do not change the output.
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    diagnostics: Optional[dict[str, Any]] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None


# --------------------------------------------------------------------------- response


class Usage(OpenAIResponseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class OutputText(OpenAIResponseModel):
    type: Literal["text"] = "text"
    text: str = ""


class OutputThinking(OpenAIResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""  # nothing is signed here: the thinking goes back to this server as plain text


class OutputToolUse(OpenAIResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


OutputBlock = Union[OutputThinking, OutputText, OutputToolUse]


class MessageObject(OpenAIResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock] = Field(default_factory=list)
    stop_reason: Optional[StopReason] = None
    stop_sequence: Optional[str] = None
    usage: Usage


class TokenCount(OpenAIResponseModel):
    input_tokens: int
