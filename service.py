"""llgtrt-bento: an OpenAI-compatible LLM server with guaranteed structured output.

`bentoml serve .` starts it, configured by the JSON5 files LLGTRT_CONFIG names and LLGTRT_* variables
(llgtrt_core/config.py, docs/configuration.md). The model comes from the BentoML model store (default
the SmolLM2-135M-Instruct pack, created on first start when the store has none). The engine the
stored model's metadata names runs in a process of its own (the embedded engine) or in this one
(TensorRT-LLM, which runs its own executor); the OpenAI API is mounted at /v1 and a streaming
`generate` method serves bentoml's own clients.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from pathlib import Path
from typing import AsyncGenerator, Optional

import bentoml

from llgtrt_core import metrics, model_store
from llgtrt_core.api.app import API_PREFIX, GENERATION_PATHS, create_app
from llgtrt_core.api.cors import ApiCors
from llgtrt_core.api.health import create_root_app
from llgtrt_core.api.completions import completion_text
from llgtrt_core.api.errors import APIError
from llgtrt_core.api.gate import RequestGate
from llgtrt_core.api.protocol import CompletionRequest
from llgtrt_core.api.route_metrics import label_traffic_metrics_by_route
from llgtrt_core.api.shutdown import SHUTDOWN, drain_on_sigterm
from llgtrt_core.chat_template import ChatTemplate
from llgtrt_core.config import TokenizerConfig, load_config
from llgtrt_core.constraints import GrammarCompiler, build_ll_tokenizer
from llgtrt_core.engine.factory import create_engine, engine_kind, resolve_api_workers
from llgtrt_core.heap import freeze_loaded_objects
from llgtrt_core.runtime import ModelRuntime
from llgtrt_core.tokenizer import Tokenizer
from llgtrt_core.reasoning import resolve_reasoning
from llgtrt_core.tools import detect_tool_format

logger = logging.getLogger("llgtrt")
CONFIG = load_config()


def ensure_model_in_store() -> None:
    """`bentoml serve` and `build` resolve the model before any hook runs, so the default is packed
    here, at import, when the store lacks it and no other model is configured."""
    if not CONFIG.model_configured:
        model_store.ensure_default_model()  # packs (and logs that it does) only when missing
    elif bentoml.models.BentoModel(CONFIG.model_tag).stored is None:
        raise RuntimeError(f"model {CONFIG.model_tag} is not in the BentoML model store; "
                           "pack it with pack_model.py (see --help)")


ensure_model_in_store()
CONFIG = resolve_api_workers(CONFIG, engine_kind(bentoml.models.get(CONFIG.model_tag).info.metadata))


def current_runtime() -> Optional[ModelRuntime]:
    return bentoml.get_current_service().runtime


openai_app = create_app(current_runtime, CONFIG.server)
root_app = create_root_app(current_runtime)  # vLLM's /health and /version
# BentoML's own routes, ours, and the OpenAI app's: any other path shares one label in /metrics.
label_traffic_metrics_by_route(
    {"/", "/livez", "/readyz", "/healthz", "/metrics", "/schema.json", "/docs.json", "/health", "/version",
     *GENERATION_PATHS,
     *(f"{API_PREFIX}{route.path}" for route in openai_app.routes)},
    ("/static_content/", "/assets/"))


def apply_tokenizer_overrides(tokenizer: Tokenizer, overrides: TokenizerConfig) -> None:
    if overrides.chat_template is not None:
        tokenizer.chat_template = ChatTemplate(Path(overrides.chat_template).read_text(), tokenizer.special_tokens)
    if overrides.eos_token_ids is not None:
        tokenizer.eos_token_ids = frozenset(overrides.eos_token_ids)


@bentoml.service(
    name="llgtrt",
    traffic={"timeout": 600},
    workers=CONFIG.server.api_workers,  # HTTP processes; the embedded engine runs in one process of its own
    endpoints={"livez": "/livez", "readyz": "/readyz"},
    # BentoML's OpenTelemetry middleware opens a span per ASGI send, so per streamed chunk (~35 us of
    # the event loop's time, a third of a chunk's cost), even when it samples nothing (its default).
    tracing={"excluded_urls": sorted(GENERATION_PATHS)},
)
@bentoml.asgi_app(openai_app, path=API_PREFIX)
@bentoml.asgi_app(root_app, path="/")
class LLM:
    # A class attribute, so `bentoml build` bundles the model into the Bento.
    model = bentoml.models.BentoModel(CONFIG.model_tag)

    def __init__(self) -> None:
        self.runtime: Optional[ModelRuntime] = None
        self._loading: Optional[asyncio.Task] = None

    @bentoml.on_startup
    async def start_loading(self) -> None:
        drain_on_sigterm()  # uvicorn's handler is in place by now
        # Load in the background so /readyz answers 503 (not a refused connection) meanwhile.
        self._loading = asyncio.create_task(self._load())

    async def _load(self) -> None:
        try:
            stored = self.model
            model_dir = Path(stored.path)
            metadata = dict(stored.info.metadata)
            tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
            apply_tokenizer_overrides(tokenizer, CONFIG.tokenizer)
            vocab_size = CONFIG.tokenizer.n_vocab_override or metadata["vocab_size"]
            # The llguidance tokenizer validates grammars here and names tokens in logprobs; masks are as
            # wide as the logits, so padded vocab ids exist and stay disallowed.
            eos_token_ids = sorted(tokenizer.eos_token_ids)
            ll_tokenizer = await asyncio.to_thread(build_ll_tokenizer, tokenizer.hf, vocab_size, eos_token_ids)
            grammars = GrammarCompiler.from_config(ll_tokenizer, CONFIG.llguidance)
            engine = metrics.MeteredEngine(create_engine(model_dir, metadata, CONFIG, vocab_size, eos_token_ids,
                                                         tokenizer.hf.eos_token_id, grammars))
            await engine.start()
            name = CONFIG.model.served_model_name or stored.tag.name
            template = tokenizer.chat_template.source if tokenizer.chat_template else None
            tool_format = detect_tool_format(template, CONFIG.tokenizer.tool_format)
            thinking = CONFIG.reasoning
            reasoning = resolve_reasoning(template, thinking.enabled, thinking.start, thinking.end,
                                          thinking.default_max_reasoning_tokens, thinking.max_reasoning_tokens_limit)
            freeze_loaded_objects()  # before /readyz says yes: its collection pauses the event loop once
            self.runtime = ModelRuntime(model_name=name, tokenizer=tokenizer, engine=engine, tool_format=tool_format,
                                        grammars=grammars, limits=CONFIG.server, reasoning=reasoning)
            logger.info("serving %s (%s) with the %s engine", name, stored.tag, metadata.get("engine"))
        except Exception:
            logger.exception("loading the model failed; /readyz stays 503")

    def __is_ready__(self) -> bool:
        return self.runtime is not None and self.runtime.engine.failure is None and not SHUTDOWN.draining

    @bentoml.on_shutdown
    async def stop(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
        if self.runtime is not None:
            await self.runtime.engine.shutdown()
            self.runtime.grammars.close()

    @bentoml.api
    async def generate(
        self, prompt: str, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None
    ) -> AsyncGenerator[str, None]:
        """Stream the completion of `prompt` as text chunks (bentoml's Python clients).

        The same path as POST /v1/completions: the request gate (GENERATION_PATHS), validation,
        sampling, detokenization. A bad request fails before the first chunk, with its status.
        """
        if self.runtime is None:
            raise bentoml.exceptions.ServiceUnavailable("the model is still loading")
        request = CompletionRequest(model=self.runtime.model_name, prompt=prompt, max_tokens=max_tokens,
                                    temperature=temperature, seed=seed)
        texts = completion_text(request, self.runtime)
        try:
            try:
                first = await anext(texts, None)
            except APIError as e:  # before the first chunk, BentoML still answers with the status
                raise _bentoml_error(e) from e
            if first is None:
                return
            yield first
            async for text in texts:
                if SHUTDOWN.cut:  # plain text has no error event: the stream just ends
                    return
                yield text
        finally:
            await texts.aclose()


def _bentoml_error(error: APIError) -> bentoml.exceptions.BentoMLException:
    info = error.info
    message = f"{info.param}: {info.message}" if info.param else info.message
    return bentoml.exceptions.BentoMLException(message, error_code=HTTPStatus(error.status_code))


# Outside the gate (added first), so preflights, which carry no API key, are answered.
if CONFIG.server.cors_allow_origins:
    LLM.add_asgi_middleware(ApiCors, allow_origins=CONFIG.server.cors_allow_origins)
# Once for every protected route: /v1/* and GENERATION_PATHS (api/gate.py).
LLM.add_asgi_middleware(RequestGate, server=CONFIG.server)
