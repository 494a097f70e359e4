"""Pick the engine a stored model's metadata calls for."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from llgtrt_core.config import RuntimeConfig
from llgtrt_core.engine.interface import Engine, LogitsPostProcessor

if TYPE_CHECKING:
    from llgtrt_core.constraints.grammar import GrammarCompiler

TENSORRT_LLM_KINDS = ("tensorrt_llm", "tensorrt_llm_engine")


def create_engine(
    model_dir: Path,
    metadata: dict[str, Any],
    runtime: RuntimeConfig,
    post_processor: Optional[LogitsPostProcessor],
    eos_token_id: int,
    grammars: Optional[GrammarCompiler] = None,  # TensorRT-LLM's worker processes rebuild with its settings
) -> Engine:
    kind = metadata.get("engine", "pytorch")
    if kind == "pytorch":
        from llgtrt_core.engine.torch_engine import TorchEngine, TorchEngineConfig

        config = TorchEngineConfig(max_batch_size=runtime.max_batch_size, max_model_len=runtime.max_model_len,
                                   device=runtime.device, dtype=runtime.dtype, cpu_threads=runtime.cpu_threads,
                                   prefill_chunk_tokens=runtime.prefill_chunk_tokens,
                                   kv_cache_free_gpu_memory_fraction=runtime.kv_cache_free_gpu_mem_fraction,
                                   kv_cache_max_tokens=runtime.kv_cache_max_tokens)
        return TorchEngine(model_dir, config, post_processor)
    if kind in TENSORRT_LLM_KINDS:
        from llgtrt_core.engine.trtllm_engine import TrtLlmEngine, config_for_stored_model

        trt_config = config_for_stored_model(
            model_dir,
            kind,
            metadata["vocab_size"],
            runtime.max_model_len or metadata["context_length"],
            eos_token_id,
            max_batch_size=runtime.max_batch_size,
            max_num_tokens=runtime.max_num_tokens,
            kv_cache_free_gpu_memory_fraction=runtime.kv_cache_free_gpu_mem_fraction,
            kv_cache_max_tokens=runtime.kv_cache_max_tokens,
            enable_block_reuse=runtime.enable_kv_cache_reuse,
        )
        return TrtLlmEngine(trt_config, post_processor, grammars)
    raise ValueError(f"stored model asks for engine {kind!r}; known: pytorch, {', '.join(TENSORRT_LLM_KINDS)}")
