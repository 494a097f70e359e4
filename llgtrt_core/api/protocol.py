"""Pydantic models of the OpenAI Chat Completions / Completions / Models API, field by field.

Shapes follow the official `openai` client's types; vLLM's extensions that users already send
(sampling extras, `structured_outputs`, `guided_*`) are accepted too. Unknown fields are refused
(OpenAI answers "Unrecognized request argument"), and known fields this server does not implement
are listed by `unsupported_params()` so the caller can refuse them by name instead of ignoring them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_serializer, model_validator

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients send null for "not set" (`"n": null`); such fields take their default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].default is None}


class ParamError(ValueError):
    """A validation failure that knows which request parameter is at fault (for the error body)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


class OpenAIResponseModel(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


# --------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIResponseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(OpenAIResponseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- constraints


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "lark_grammar", "llguidance"]
    json_schema: Optional[JsonSchemaResponseFormat] = None
    lark_grammar: Optional[str] = None  # type == "lark_grammar"
    grammar: Optional[str] = None  # type == "llguidance"


class StructuredOutputsParams(OpenAIBaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[StrictBool] = None
    whitespace_pattern: Optional[str] = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False

    @property
    def json(self) -> Optional[Union[str, dict[str, Any]]]:  # type: ignore[override]
        return self.json_


class ConstraintFields(OpenAIBaseModel):
    """Every way a request can constrain its output; `llgtrt_core.constraints` reads these."""

    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # JSON schemas: default bounds on numbers (docs/sampling.md); null: the server's default.
    bounded_numbers: Optional[StrictBool] = None


# --------------------------------------------------------------------------- shared request fields


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False
    include_obfuscation: StrictBool = False  # we never pad deltas, so there is nothing to obfuscate


_MAX_TOKEN_ID_DIGITS = 10


class SamplingFields(OpenAIBaseModel):
    """Fields shared by chat and legacy completion requests (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None  # None: the served model (vLLM)
    n: int = Field(default=1, ge=1, le=128)
    seed: Optional[int] = Field(default=None, ge=-(2**63), le=2**63 - 1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = Field(default=None)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> -100..100
    user: Optional[str] = None
    # vLLM sampling extras
    top_k: Optional[int] = Field(default=None, ge=-1)  # 0 or -1: no top-k cut
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Which distribution logprobs report: the model's (raw) or the sampled-from one (docs/sampling.md).
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # Reasoning models: thinking tokens before the answer (docs/reasoning.md); 0: none; null: the server's default.
    max_reasoning_tokens: Optional[int] = Field(default=None, ge=0)
    # Constrained requests: steer a looping answer out of its loop (docs/sampling.md); null: the server's default.
    loop_guard: Optional[StrictBool] = None
    # llama.cpp's DRY sampler (docs/sampling.md); off while dry_multiplier is 0.
    dry_multiplier: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    dry_base: float = Field(default=1.75, ge=1.0, allow_inf_nan=False)
    dry_allowed_length: int = Field(default=2, ge=1)
    dry_penalty_last_n: int = Field(default=-1, ge=-1)  # -1: the whole context; 0: off
    dry_sequence_breakers: list[str] = Field(default_factory=lambda: list(DRY_SEQUENCE_BREAKERS), max_length=64)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, logit_bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, bias in (logit_bias or {}).items():
            token_id = key.strip()  # ASCII digits only: int() also takes "²"-like digits, and refuses 5,000 of them
            if not (token_id.isascii() and token_id.isdigit() and len(token_id) <= _MAX_TOKEN_ID_DIGITS):
                raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for {key}")
        return logit_bias

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _check_dry_sequence_breakers(cls, breakers: list[str]) -> list[str]:
        if any(not breaker or len(breaker) > 64 for breaker in breakers):
            raise ParamError("dry_sequence_breakers", "dry_sequence_breakers must be strings of 1 to 64 characters")
        return breakers

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: Optional[Union[str, list[str]]]) -> Optional[Union[str, list[str]]]:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stop

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def token_logit_bias(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}


# --------------------------------------------------------------------------- chat request


class ChatCompletionContentPartText(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatCompletionContentPartRefusal(OpenAIBaseModel):
    type: Literal["refusal"]
    refusal: str


class ChatCompletionContentPartOther(BaseModel):
    """Images, audio and files: accepted by the schema, refused with a clear message."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "video_url", "audio_url"]


ChatCompletionContentPart = Union[
    ChatCompletionContentPartText, ChatCompletionContentPartRefusal, ChatCompletionContentPartOther
]


def _without(data: Any, client_side: frozenset[str]) -> Any:
    """The official SDK's `parse()` returns messages with client-side fields (`parsed`,
    `parsed_arguments`, ...); a client appends them to its conversation and sends them back, so
    they are accepted and dropped (unknown fields elsewhere stay a 400)."""
    if not isinstance(data, dict):
        return data
    return {key: value for key, value in data.items() if key not in client_side}


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str

    @model_validator(mode="before")
    @classmethod
    def _drop_client_side_fields(cls, data: Any) -> Any:
        return _without(data, frozenset({"parsed_arguments"}))


class ChatCompletionMessageToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessageParam(BaseModel):
    """One message of the conversation. Extra keys are kept: some templates read them."""

    model_config = ConfigDict(extra="allow")
    role: Literal["developer", "system", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ChatCompletionContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ChatCompletionMessageToolCall]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _drop_client_side_fields(cls, data: Any) -> Any:
        return _without(data, frozenset({"parsed", "annotations", "audio"}))


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields, ConstraintFields):
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)  # deprecated alias of max_completion_tokens
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[ChatCompletionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    # End the answer where the model starts repeating a tool call it made (same name and arguments).
    stop_repeated_tool_calls: StrictBool = True
    functions: Optional[list[FunctionDefinition]] = None  # deprecated by tools
    function_call: Optional[Union[Literal["none", "auto"], ChatCompletionNamedFunction]] = None
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[Literal["text", "audio"]]] = None
    prediction: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    web_search_options: Optional[dict[str, Any]] = None
    moderation: Optional[dict[str, Any]] = None
    # Bookkeeping fields that do not change the output.
    metadata: Optional[dict[str, str]] = None
    store: Optional[StrictBool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    # vLLM chat extras
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs to be true")
        return self

    @property
    def num_logprobs(self) -> Optional[int]:
        """Alternatives reported per generated token; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_candidates(self) -> int:
        return self.n

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported_params(self) -> list[str]:
        in_use = {
            "audio": self.audio is not None,
            "modalities": self.modalities not in (None, ["text"]),
            "prediction": self.prediction is not None,
            "verbosity": self.verbosity is not None,
            "web_search_options": self.web_search_options is not None,
            "moderation": self.moderation is not None,
            "echo": self.echo,
        }
        return [name for name, used in in_use.items() if used]


# --------------------------------------------------------------------------- completion request


class CompletionRequest(SamplingFields, ConstraintFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's default for completions
    best_of: Optional[int] = Field(default=None, ge=1, le=128)
    echo: StrictBool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=5)
    suffix: Optional[str] = None
    add_special_tokens: StrictBool = True  # vLLM: add BOS and friends to text prompts

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ParamError("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and self.num_candidates > self.n:
            raise ParamError("best_of", "best_of greater than n cannot be streamed")
        return self

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        """Alternatives reported per token (besides the sampled one); None: no logprobs."""
        return self.logprobs

    @property
    def num_candidates(self) -> int:
        """Completions generated per prompt; the best n are returned."""
        return self.best_of or self.n

    def unsupported_params(self) -> list[str]:
        return ["suffix"] if self.suffix else []


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(OpenAIResponseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None  # None: the engine does not say

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> UsageInfo:
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class TopLogprob(OpenAIResponseModel):
    token: str
    bytes: Optional[list[int]] = None  # the token's UTF-8 bytes (a token may hold part of a character)
    logprob: float


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(OpenAIResponseModel):
    content: Optional[list[ChatCompletionTokenLogprob]] = None
    refusal: Optional[list[ChatCompletionTokenLogprob]] = None


class CompletionLogprobs(OpenAIResponseModel):
    """Legacy completions' logprobs: parallel lists, one entry per token (echoed prompt first)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)  # None for the first prompt token
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None


class ChatMessage(OpenAIResponseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # vLLM's: the thinking of a reasoning model (docs/reasoning.md)
    refusal: Optional[str] = None
    tool_calls: Optional[list[ChatCompletionMessageToolCall]] = None
    function_call: Optional[FunctionCall] = None  # legacy `functions` requests


class ChatCompletionResponseChoice(OpenAIResponseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class ChatCompletionResponse(OpenAIResponseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class OpenAIDeltaModel(OpenAIResponseModel):
    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        # The client's accumulator concatenates every string it sees: send each key only when set.
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(OpenAIDeltaModel):
    name: Optional[str] = None  # first delta of a call only
    arguments: Optional[str] = None  # a fragment of the arguments JSON


class DeltaToolCall(OpenAIDeltaModel):
    index: int
    id: Optional[str] = None  # first delta of a call only
    type: Optional[Literal["function"]] = None  # first delta of a call only
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(OpenAIDeltaModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    function_call: Optional[DeltaFunctionCall] = None  # legacy `functions` requests

    def is_empty(self) -> bool:
        """Nothing to send (checked per streamed chunk: cheaper than dumping the model)."""
        return (self.role is None and self.content is None and self.reasoning_content is None
                and self.tool_calls is None and self.function_call is None)


class ChatCompletionResponseStreamChoice(OpenAIResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class ChatCompletionStreamResponse(OpenAIResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class CompletionResponseChoice(OpenAIResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class CompletionResponse(OpenAIResponseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class CompletionStreamResponse(OpenAIResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class ModelCard(OpenAIResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "llgtrt"
    max_model_len: Optional[int] = None


class ModelList(OpenAIResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StepPhaseStats(OpenAIResponseModel):
    count: int
    wall_s: float
    cpu_s: float  # CPU time of the thread that ran the phase; wall - cpu: waits (GPU, other threads, GIL)


class PrefixCacheStats(OpenAIResponseModel):
    """The embedded engine's prefix cache (llgtrt_core/engine/block_manager.py)."""

    queries: int  # prompt tokens looked up
    hits: int  # of those, found
    cached_blocks: int  # blocks holding a cached prefix now
    evictions: int  # cached blocks taken for new KV


class EngineStats(OpenAIResponseModel):
    num_active: int  # engine requests submitted and not yet finished
    num_steps: Optional[int] = None  # the embedded engine's steps so far
    num_mixed_steps: Optional[int] = None  # of those, steps that decoded and prefilled in one forward pass
    num_spread_prompt_steps: Optional[int] = None  # CPU: prompt-only steps run on more torch threads
    num_shared_kernel_steps: Optional[int] = None  # CPU: steps whose quantized matmuls shared threads
    num_sit_outs: Optional[int] = None  # draws dropped: a slow grammar's mask, filled apart, was late
    step_phases: dict[str, StepPhaseStats] = {}  # totals per phase of its step loop (llgtrt_core/engine/step_profile.py)
    prefix_cache: Optional[PrefixCacheStats] = None


# --------------------------------------------------------------------------- tokenize (vLLM's shapes)


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(OpenAIBaseModel):
    """Messages rendered exactly as /chat/completions renders them, tools included."""

    model: Optional[str] = None
    messages: list[ChatCompletionMessageParam] = Field(min_length=1)
    tools: Optional[list[ChatCompletionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoice]] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: StrictBool = False  # the template writes BOS and friends itself
    return_token_strs: StrictBool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIResponseModel):
    prompt: str
