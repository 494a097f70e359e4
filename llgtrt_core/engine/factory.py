"""Pick the engine a stored model's metadata calls for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from llgtrt_core.engine.interface import Engine, LogitsPostProcessor
from llgtrt_core.settings import Settings

TENSORRT_LLM_KINDS = ("tensorrt_llm", "tensorrt_llm_engine")


def create_engine(
    model_dir: Path,
    metadata: dict[str, Any],
    settings: Settings,
    post_processor: Optional[LogitsPostProcessor],
    eos_token_id: int,
) -> Engine:
    kind = metadata.get("engine", "pytorch")
    if kind == "pytorch":
        from llgtrt_core.engine.torch_engine import TorchEngine, TorchEngineConfig

        config = TorchEngineConfig(settings.max_batch_size, settings.max_model_len, settings.device)
        return TorchEngine(model_dir, config, post_processor)
    if kind in TENSORRT_LLM_KINDS:
        from llgtrt_core.engine.trtllm_engine import TrtLlmEngine, config_for_stored_model

        context_length = settings.max_model_len or metadata["context_length"]
        trt_config = config_for_stored_model(model_dir, kind, metadata["vocab_size"], context_length, eos_token_id,
                                             max_batch_size=settings.max_batch_size)
        return TrtLlmEngine(trt_config, post_processor)
    raise ValueError(f"stored model asks for engine {kind!r}; known: pytorch, {', '.join(TENSORRT_LLM_KINDS)}")
