"""The service configuration: JSON5 files merged in order, then LLGTRT_* environment overrides.

Files come from LLGTRT_CONFIG (paths separated by commas or colons). Objects merge recursively,
scalars and arrays replace; an unknown key is an error naming it. Every option has a default, so
no file is needed. `python -m llgtrt_core.config --print-config` prints every option with its
doc comment, options left at their default commented out (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import json5

DEFAULT_MODEL_TAG = "smollm2-135m-instruct:latest"
CONFIG_ENV = "LLGTRT_CONFIG"


class ConfigError(ValueError):
    pass


def option(default: Any, doc: str) -> Any:
    """A config field: its default and the comment --print-config writes above it."""
    if isinstance(default, (dict, list)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: default, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ModelConfig:
    tag: Optional[str] = option(None, f"BentoML model store tag to serve; null: {DEFAULT_MODEL_TAG}, "
                                      "packed on first start when missing. Env LLGTRT_MODEL.")
    served_model_name: Optional[str] = option(None, "The model id clients send and /v1/models lists; "
                                                    "null: the tag's name. Env LLGTRT_SERVED_MODEL_NAME.")


@dataclass(frozen=True)
class RuntimeConfig:
    max_batch_size: int = option(8, "Sequences decoded together in one engine step; more wait in the engine's "
                                    "queue. Env LLGTRT_MAX_BATCH_SIZE.")
    max_num_tokens: Optional[int] = option(None, "TensorRT-LLM: tokens one step may hold (prefill chunks "
                                                 "included); null: the engine's build value.")
    max_model_len: Optional[int] = option(None, "Prompt + completion tokens of one sequence; null: the model's "
                                                "context length. Env LLGTRT_MAX_MODEL_LEN.")
    kv_cache_free_gpu_mem_fraction: float = option(0.9, "Fraction of the free GPU memory the KV cache takes "
                                                        "after the weights are loaded.")
    kv_cache_max_tokens: Optional[int] = option(None, "Upper bound on KV-cache tokens; null: as many as the memory "
                                                      "fraction holds (PyTorch engine on cpu: the cache grows as "
                                                      "needed).")
    enable_kv_cache_reuse: bool = option(True, "Prefix caching: keep the KV cache of prompt prefixes after their "
                                               "requests end and reuse it for prompts that start the same way "
                                               "(both engines).")
    tensor_parallel_size: int = option(1, "TensorRT-LLM: GPUs one model is split over; above 1 its executor runs in "
                                          "MPI worker processes (docs/tensorrt-llm.md, multi-GPU).")
    device: Optional[str] = option(None, "PyTorch engine: torch device; null: cuda when available, else cpu. "
                                         "Env LLGTRT_DEVICE.")
    dtype: Optional[str] = option(None, "PyTorch engine: weights and activations dtype (float32, bfloat16, "
                                        "float16); null: bfloat16 on cuda and on a cpu with bfloat16 kernels "
                                        "(AVX-512 BF16, AMX), else float32. Env LLGTRT_DTYPE.")
    weights: Optional[str] = option(None, "PyTorch engine: int8 or int4 (weight-only int8/int4 matmuls, cpu only: "
                                          "a decode step reads a quarter/an eighth of float32's bytes) or dense (the "
                                          "dtype's); null: on cpu when the dtype is bfloat16, int4 if the checkpoint "
                                          "holds in int4 exactly (dequantized from Q4_1, as the default model), else "
                                          "int8; dense elsewhere. Env LLGTRT_WEIGHTS.")
    cpu_threads: Optional[int] = option(None, "PyTorch engine on cpu: torch intra-op threads; null: all cores "
                                              "but one (the event loop and llguidance need one); the lm_head "
                                              "alone runs on every core. Env LLGTRT_CPU_THREADS.")
    cpu_compile: Optional[bool] = option(None, "PyTorch engine on cpu: compile the decode step's layers "
                                               "(torch.compile, a C++ compiler needed) in the background at start, "
                                               "the eager step serving meanwhile; null: on with int8/int4 weights. Env "
                                               "LLGTRT_CPU_COMPILE (true/false).")
    cpu_gemm_templates: bool = option(True, "PyTorch engine on cpu, compiled step, where the quantized matmuls "
                                            "are aten's (a cpu without AVX-512 VNNI): the weights frozen into its "
                                            "graphs and inductor's C++ GEMM template for those matmuls where it "
                                            "times faster (1 row, and 5-12 rows in a graph of their own; longer "
                                            "compile). Env LLGTRT_CPU_GEMM_TEMPLATES (true/false).")
    cpu_prompt_threads: Optional[int] = option(None, "PyTorch engine on cpu, compiled step with GEMM templates: "
                                                     "torch threads of a step that only prefills 5-12 tokens (one "
                                                     "client waits for its first token), in a graph of their own, "
                                                     "taken only while other processes leave the cores idle; null: "
                                                     "every core; 0: off. Env LLGTRT_CPU_PROMPT_THREADS.")
    cpu_kernel_threads: Optional[int] = option(None, "PyTorch engine on cpu with AVX-512 VNNI: threads that share "
                                                     "a step's quantized matmuls (our kernels), taken only while "
                                                     "other processes leave the cores idle; null: every core; 1: "
                                                     "the engine thread alone. Env LLGTRT_CPU_KERNEL_THREADS.")
    prefill_chunk_tokens: Optional[int] = option(None, "PyTorch engine: prompt tokens prefilled per engine step; a "
                                                       "longer prompt is prefilled a chunk per step while running "
                                                       "sequences keep decoding. null or 0: whole prompts in one "
                                                       "step. Env LLGTRT_PREFILL_CHUNK_TOKENS.")
    mixed_prefill: bool = option(True, "PyTorch engine: a step that decodes and admits prompts runs both in one "
                                       "forward pass (the weights read once); false: the prompts in a pass of "
                                       "their own, the decode under CUDA graphs.")

    def __post_init__(self) -> None:
        if self.weights not in (None, "int8", "int4", "dense"):
            raise ConfigError(f"config key 'runtime.weights': expected int8, int4, dense or null, got {self.weights!r}")


@dataclass(frozen=True)
class TokenizerConfig:
    chat_template: Optional[str] = option(None, "Path of a Jinja chat template replacing the model's own "
                                                "(rendered in a sandbox).")
    n_vocab_override: Optional[int] = option(None, "Vocabulary size llguidance assumes (the logits width); "
                                                   "null: the model's vocab_size.")
    eos_token_ids: Optional[list[int]] = option(None, "Tokens that end generation, replacing the tokenizer's "
                                                      "EOS tokens; null: from the model's tokenizer files.")
    tool_format: Optional[str] = option(None, "Tool-call format the model writes: hermes, llama3_json, mistral "
                                              "or generic_json; null: detected from the chat template. Env "
                                              "LLGTRT_TOOL_FORMAT.")

    def __post_init__(self) -> None:
        if self.tool_format is None:
            return
        from llgtrt_core.tools import TOOL_FORMATS  # imports torch (via the constraints): only when set

        if self.tool_format not in TOOL_FORMATS:
            raise ConfigError(f"config key 'tokenizer.tool_format': expected one of {', '.join(TOOL_FORMATS)}, "
                              f"got {self.tool_format!r}")


@dataclass(frozen=True)
class LimitsConfig:
    """llguidance's LLParserLimits: a grammar past them is refused at compile time (400) or, mid-
    generation, ends its request with an error."""

    max_items_in_row: int = option(2000, "Earley items in one parser row (grows with ambiguity and "
                                         "right recursion).")
    initial_lexer_fuel: int = option(1_000_000, "Lexer work allowed to build the first mask.")
    step_lexer_fuel: int = option(200_000, "Lexer work allowed per generated token.")
    step_max_items: int = option(50_000, "Earley items allowed per generated token.")
    max_lexer_states: int = option(250_000, "Lexer DFA states per grammar.")
    max_grammar_size: int = option(500_000, "Grammar size (symbols and rules) after expansion.")
    precompute_large_lexemes: bool = option(True, "Precompute the lexer for large lexemes at compile time.")
    verbose_errors: bool = option(False, "Quote parser state and grammar in errors (they go back to clients).")


@dataclass(frozen=True)
class LoopGuardConfig:
    """Loop-aware constrained decoding (llgtrt_core/constraints/loop_guard.py, docs/sampling.md)."""

    enabled: bool = option(True, "Steer constrained answers out of a loop by default (a request's "
                                 "`loop_guard` overrides it).")
    min_span: int = option(32, "A loop: the last tokens repeat one period over at least this many tokens ...")
    min_repeats: int = option(3, "... and at least this many times.")
    closing_margin: int = option(24, "Steer to the nearest ending the grammar allows once the tokens left of "
                                     "max_tokens are this many (at most a tenth of max_tokens) plus one per "
                                     "bracket open outside strings.")

    def __post_init__(self) -> None:
        if self.min_span < 2 or self.min_repeats < 2:
            raise ConfigError("config keys 'llguidance.loop_guard.min_span' and '...min_repeats' must be at least 2")
        if self.closing_margin < 0:
            raise ConfigError("config key 'llguidance.loop_guard.closing_margin' must be at least 0")


@dataclass(frozen=True)
class NumberBoundsConfig:
    """JSON schemas: integers and numbers get bounds they lack, so that digits end (a request's
    `bounded_numbers` overrides `enabled`; docs/sampling.md)."""

    enabled: bool = option(True, "Bound numbers by default.")
    integer_digits: int = option(18, "|value| <= 10**integer_digits unless the schema gives minimum / maximum "
                                     "(18: inside int64); no exponents.")
    fraction_digits: int = option(9, "Numbers: at most this many digits after the point unless the schema "
                                     "gives multipleOf.")


@dataclass(frozen=True)
class LlguidanceConfig:
    limits: LimitsConfig = option(LimitsConfig(), "Parser limits, per grammar.")
    log_level: int = option(0, "llguidance's own logging to stderr: 0 silent, 1 warnings, 2 verbose.")
    grammar_cache_size: int = option(256, "Compiled grammars kept, by grammar text.")
    max_grammar_chars: int = option(1_000_000, "Longest grammar text a request may build (its schema with its "
                                               "options, or its Lark grammar, regex, tools); longer: 400. "
                                               "0: no limit.")
    compile_threads: Optional[int] = option(None, "Threads compiling grammars; null: min(4, cores).")
    mask_threads: Optional[int] = option(None, "Threads committing tokens and computing masks for a step's "
                                               "constrained rows (llguidance's pool); null: 80% of the cores, "
                                               "at most 32. Env LLGTRT_MASK_THREADS.")
    fill_process: Optional[bool] = option(None, "Commit tokens, compute masks and run the loop guards in a process "
                                                "of their own, out of the engine thread's GIL (the embedded engine; "
                                                "fast-forward then only at a request's start); null: where the engine "
                                                "runs on CUDA. Env LLGTRT_FILL_PROCESS.")
    slow_mask_ms: Optional[float] = option(0.5, "A grammar whose masks take this long or more on average (probed "
                                                "in the background when it is first compiled) has its rows filled "
                                                "apart from the batch's: steps do not wait for them, and its "
                                                "tokens come slower; null: no probe, every row in the batch.")
    whitespace_flexible: bool = option(False, "JSON schemas: allow free whitespace between JSON tokens by "
                                              "default (a request's whitespace_pattern overrides it).")
    loop_guard: LoopGuardConfig = option(LoopGuardConfig(), "Loop-aware constrained decoding.")
    number_bounds: NumberBoundsConfig = option(NumberBoundsConfig(), "Default bounds on JSON numbers.")

    def __post_init__(self) -> None:
        if self.max_grammar_chars < 0:
            raise ConfigError("config key 'llguidance.max_grammar_chars' must be 0 (no limit) or more")
        for key in ("compile_threads", "mask_threads"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"config key 'llguidance.{key}' must be at least 1")
        if self.slow_mask_ms is not None and self.slow_mask_ms < 0:
            raise ConfigError("config key 'llguidance.slow_mask_ms' must be at least 0")


@dataclass(frozen=True)
class ReasoningConfig:
    """Models that think before they answer (docs/reasoning.md): the thinking section's markers and budget."""

    enabled: Optional[bool] = option(None, "Give every chat, completion, Responses and Messages answer a thinking "
                                           "section first; null: when the markers are set or the chat template is "
                                           "of a known reasoning family (Qwen3, DeepSeek-R1, gpt-oss).")
    start: Optional[str] = option(None, "The marker opening the thinking (text; an added token by its text, "
                                        "e.g. \"<think>\"); null: the chat template's family's.")
    end: Optional[str] = option(None, "The marker closing the thinking; null: the chat template's family's.")
    default_max_reasoning_tokens: int = option(1024, "Thinking tokens of a request that names no "
                                                     "max_reasoning_tokens; past them the end marker is forced.")
    max_reasoning_tokens_limit: int = option(32768, "The largest max_reasoning_tokens a request may ask for.")

    def __post_init__(self) -> None:
        if self.start == "" or self.end == "":
            raise ConfigError("config keys 'reasoning.start' and 'reasoning.end' must not be empty")
        if self.default_max_reasoning_tokens > self.max_reasoning_tokens_limit:
            raise ConfigError("config key 'reasoning.default_max_reasoning_tokens' must not exceed "
                              "'reasoning.max_reasoning_tokens_limit'")


@dataclass(frozen=True)
class ServerConfig:
    api_key: Optional[str] = option(None, "When set, /v1/* and /generate require `Authorization: Bearer "
                                          "<api_key>`. Env LLGTRT_API_KEY.")
    api_workers: Optional[int] = option(None, "Processes doing HTTP, templates, tokenizing and detokenizing in "
                                              "front of the one engine process (the embedded engine; TensorRT-LLM "
                                              "takes 1): one event loop streams ~18k tokens/s. null: 1 on a CPU, "
                                              "with a GPU a core in four up to 4. Request limits are per worker; "
                                              "the workers share the stored responses. Env LLGTRT_API_WORKERS.")
    max_request_bytes: int = option(8 * 1024 * 1024, "Largest request body of /v1/* and /generate; larger ones "
                                                      "get 413. 0: no limit.")
    max_concurrent_requests: int = option(256, "Generation sequences handed to the engine at once, a request "
                                               "taking one place per prompt and choice (n, or best_of); the "
                                               "engine batches max_batch_size of them. 0: no limit (nor queue).")
    max_queued_requests: int = option(256, "Generation requests waiting for their places; past them a "
                                           "request gets 429 with Retry-After.")
    retry_after_seconds: int = option(1, "The Retry-After of a 429.")
    max_sequences_per_request: int = option(128, "Prompts x choices (n, or best_of) one request may ask for; "
                                                 "past it a 400 names the fields. 0: no limit.")
    max_prompt_chars: int = option(1_000_000, "Characters of one request's prompt text (all prompts, or all "
                                              "messages' content); past it a 400 before tokenizing. 0: no "
                                              "limit.")
    max_messages: int = option(4096, "Messages of one chat or tokenize request; past it a 400. 0: no limit.")
    max_tools: int = option(128, "Tools (and legacy functions) of one request; past it a 400. 0: no limit.")
    cors_allow_origins: list[str] = option([], "Origins browsers may call /v1/* from (CORS), e.g. "
                                               "[\"https://app.example.com\"] or [\"*\"]; empty: CORS off.")
    response_store_size: int = option(1024, "Responses API: responses kept for previous_response_id and "
                                            "GET /v1/responses/{id}, per replica (the oldest go first): in "
                                            "memory, or in a SQLite file its api_workers share. 0: nothing "
                                            "is stored.")
    response_store_ttl_seconds: int = option(3600, "Responses API: how long a stored response is kept.")

    def __post_init__(self) -> None:
        if self.api_workers is not None and self.api_workers < 1:
            raise ConfigError("config key 'server.api_workers' must be at least 1")

    @property
    def several_api_workers(self) -> bool:
        """Whether API workers share the engine process and the stored responses (null, not resolved
        by the service, as in an app built for a test: one)."""
        return (self.api_workers or 1) > 1


@dataclass(frozen=True)
class Config:
    model: ModelConfig = option(ModelConfig(), "Which stored model to serve.")
    runtime: RuntimeConfig = option(RuntimeConfig(), "The engine: batching, token budget, KV cache, device.")
    tokenizer: TokenizerConfig = option(TokenizerConfig(), "Tokenizer and chat template overrides.")
    llguidance: LlguidanceConfig = option(LlguidanceConfig(), "Structured output (llguidance).")
    reasoning: ReasoningConfig = option(ReasoningConfig(), "Reasoning models: the thinking section.")
    server: ServerConfig = option(ServerConfig(), "HTTP: authentication, request limits, CORS, stored responses.")

    @property
    def model_tag(self) -> str:
        return self.model.tag or DEFAULT_MODEL_TAG

    @property
    def model_configured(self) -> bool:
        """False: the default tag, which the service packs itself when the store lacks it."""
        return self.model.tag is not None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "Config":
        return _build(cls, data, "")


# Environment variables kept from before the config files existed; they win over the files.
ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "LLGTRT_MODEL": ("model", "tag"),
    "LLGTRT_SERVED_MODEL_NAME": ("model", "served_model_name"),
    "LLGTRT_MAX_BATCH_SIZE": ("runtime", "max_batch_size"),
    "LLGTRT_MAX_MODEL_LEN": ("runtime", "max_model_len"),
    "LLGTRT_DEVICE": ("runtime", "device"),
    "LLGTRT_DTYPE": ("runtime", "dtype"),
    "LLGTRT_WEIGHTS": ("runtime", "weights"),
    "LLGTRT_CPU_THREADS": ("runtime", "cpu_threads"),
    "LLGTRT_CPU_COMPILE": ("runtime", "cpu_compile"),
    "LLGTRT_CPU_GEMM_TEMPLATES": ("runtime", "cpu_gemm_templates"),
    "LLGTRT_CPU_PROMPT_THREADS": ("runtime", "cpu_prompt_threads"),
    "LLGTRT_CPU_KERNEL_THREADS": ("runtime", "cpu_kernel_threads"),
    "LLGTRT_PREFILL_CHUNK_TOKENS": ("runtime", "prefill_chunk_tokens"),
    "LLGTRT_TOOL_FORMAT": ("tokenizer", "tool_format"),
    "LLGTRT_API_KEY": ("server", "api_key"),
    "LLGTRT_API_WORKERS": ("server", "api_workers"),
    "LLGTRT_MASK_THREADS": ("llguidance", "mask_threads"),
    "LLGTRT_FILL_PROCESS": ("llguidance", "fill_process"),
}


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Objects merge recursively; scalars and arrays in `override` replace those in `base`."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_paths(env: Mapping[str, str]) -> list[Path]:
    return [Path(p) for p in re.split(r"[,:]", env.get(CONFIG_ENV, "")) if p.strip()]


def read_file(path: Path) -> dict[str, Any]:
    try:
        data = json5.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"config file {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be an object")
    return data


def load_config(paths: Optional[Sequence[Path]] = None, env: Optional[Mapping[str, str]] = None) -> Config:
    """Defaults, then each file in order (default: LLGTRT_CONFIG's), then the LLGTRT_* variables."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    for path in config_paths(env) if paths is None else paths:
        merged = merge(merged, read_file(Path(path)))
    for name, (section, key) in ENV_OVERRIDES.items():
        if env.get(name):
            value = env[name]
            hint = typing.get_type_hints(typing.get_type_hints(Config)[section])[key]
            if _base_type(hint) is int:
                if not value.isdigit():
                    raise ConfigError(f"{name}: expected a non-negative integer, got {value!r}")
                value = int(value)
            elif _base_type(hint) is bool:
                if value.lower() not in ("true", "false"):
                    raise ConfigError(f"{name}: expected true or false, got {value!r}")
                value = value.lower() == "true"
            merged = merge(merged, {section: {key: value}})
    return Config.from_mapping(merged)


def _base_type(hint: Any) -> Any:
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key {path.rstrip('.') or '(top level)'!r}: expected an object, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown config key {path + key!r} (known: {', '.join(sorted(known))})")
    values = {}
    for key, value in data.items():
        hint = _base_type(hints[key])
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value, f"{path}{key}.")
        else:
            values[key] = _checked(value, hints[key], f"{path}{key}")
    return cls(**values)


def _checked(value: Any, hint: Any, name: str) -> Any:
    optional = type(None) in typing.get_args(hint)
    base = _base_type(hint)
    if value is None and optional:
        return None
    expected = typing.get_origin(base) or base
    ok = isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if ok and expected is list:
        (item,) = typing.get_args(base)
        ok = all(isinstance(v, item) and not isinstance(v, bool) for v in value)
    if not ok:
        raise ConfigError(f"config key {name!r}: expected {_type_name(hint)}, got {value!r}")
    if expected is int and value < 0:
        raise ConfigError(f"config key {name!r}: must not be negative, got {value}")
    return value


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "null")


def render(config: Config) -> str:
    """The whole configuration as JSON5: a comment on every option; options at their default are
    commented out, so the output is a valid config file that changes nothing but what was set."""
    return "{\n" + "\n".join(_render_fields(config, type(config)(), 1)) + "\n}\n"


def _render_fields(value: Any, default: Any, depth: int) -> list[str]:
    indent = "  " * depth
    lines: list[str] = []
    for f in dataclasses.fields(value):
        current, initial = getattr(value, f.name), getattr(default, f.name)
        lines += [f"{indent}// {line}" for line in textwrap.wrap(f.metadata["doc"], 100 - len(indent), break_long_words=False, break_on_hyphens=False)]
        if dataclasses.is_dataclass(current):
            lines += [f'{indent}"{f.name}": {{', *_render_fields(current, initial, depth + 1), f"{indent}}},"]
        else:
            comment = "// " if current == initial else ""
            lines.append(f'{indent}{comment}"{f.name}": {json5.dumps(current)},')
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llgtrt_core.config", description=__doc__.splitlines()[0])
    parser.add_argument("--print-config", action="store_true", help="print the whole configuration with comments")
    parser.add_argument("--config", action="append", type=Path, metavar="FILE",
                        help=f"a JSON5 config file (repeatable; default: ${CONFIG_ENV})")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.print_config:
        parser.print_help()
        return 0
    sys.stdout.write(render(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
