"""Pick the engine a stored model's metadata calls for."""

from __future__ import annotations

import dataclasses
import glob
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from llgtrt_core.config import Config
from llgtrt_core.engine.interface import Engine

if TYPE_CHECKING:
    from llgtrt_core.constraints.grammar import GrammarCompiler

TENSORRT_LLM_KINDS = ("tensorrt_llm", "tensorrt_llm_engine")


def engine_kind(metadata: dict[str, Any]) -> str:
    """The engine a stored model's metadata names (models packed before the field: the embedded one)."""
    return metadata.get("engine", "pytorch")


def resolve_api_workers(config: Config, engine_kind: str) -> Config:
    """`server.api_workers` as a number: null is 1 on a CPU and, with a GPU, a core in four up to 4
    (docs/architecture.md). Looks for the GPU without importing torch (this runs at import)."""
    if config.server.api_workers is not None:
        return config
    device = config.runtime.device
    if device is not None:
        gpu = device.startswith("cuda")
    else:
        gpu = bool(glob.glob("/dev/nvidia[0-9]*")) and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")
    workers = min(4, max(1, (os.cpu_count() or 1) // 4)) if gpu and engine_kind == "pytorch" else 1
    return dataclasses.replace(config, server=dataclasses.replace(config.server, api_workers=workers))


def create_engine(
    model_dir: Path,
    metadata: dict[str, Any],
    config: Config,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    eos_token_id: int,  # the tokenizer's own: TensorRT-LLM's end_id
    grammars: GrammarCompiler,
) -> Engine:
    """The embedded engine runs in a process of its own (`EngineCoreClient`), which builds its own
    constraint stage; TensorRT-LLM runs in this one with a mask post-processor built here."""
    runtime = config.runtime
    kind = engine_kind(metadata)
    if kind == "pytorch":
        from llgtrt_core.engine.core_client import EngineCoreClient, api_worker_index, engine_socket_path
        from llgtrt_core.engine.core_protocol import CoreSpec
        from llgtrt_core.engine.torch_engine_config import TorchEngineConfig

        engine_config = TorchEngineConfig(max_batch_size=runtime.max_batch_size, max_model_len=runtime.max_model_len,
                                          device=runtime.device, dtype=runtime.dtype, weights=runtime.weights,
                                          cpu_threads=runtime.cpu_threads, cpu_compile=runtime.cpu_compile,
                                          cpu_gemm_templates=runtime.cpu_gemm_templates,
                                          cpu_prompt_threads=runtime.cpu_prompt_threads,
                                          cpu_kernel_threads=runtime.cpu_kernel_threads,
                                          prefill_chunk_tokens=runtime.prefill_chunk_tokens,
                                          mixed_prefill=runtime.mixed_prefill,
                                          kv_cache_free_gpu_memory_fraction=runtime.kv_cache_free_gpu_mem_fraction,
                                          kv_cache_max_tokens=runtime.kv_cache_max_tokens,
                                          prefix_caching=runtime.enable_kv_cache_reuse)
        shared = config.server.several_api_workers
        spec = CoreSpec(str(model_dir), engine_config, vocab_size, tuple(eos_token_ids), config.llguidance,
                        listen_path=engine_socket_path() if shared else None)
        client = EngineCoreClient(spec, owner=not shared or api_worker_index() == 1)
        grammars.on_miss = client.precompile  # the tools grammar, compiled here to name a failing tool
        grammars.compiled_by_engine = True
        return client
    if kind in TENSORRT_LLM_KINDS:
        if config.server.several_api_workers:  # each worker would load its own copy of the model
            raise ValueError("server.api_workers above 1 needs the embedded engine; TensorRT-LLM runs in the "
                             "API worker's process")
        from llgtrt_core.constraints.postprocessor import MaskPostProcessor
        from llgtrt_core.engine.trtllm_engine import TrtLlmEngine, config_for_stored_model
        from llgtrt_core.kernels import cuda_kernel_available

        post_processor = MaskPostProcessor(grammars.tokenizer, max_batch_size=runtime.max_batch_size,
                                           num_threads=config.llguidance.mask_threads)
        cuda_kernel_available()  # build (or load) the CUDA mask kernel now, not on the first constrained request
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
            tensor_parallel_size=runtime.tensor_parallel_size,
        )
        return TrtLlmEngine(trt_config, post_processor, grammars)
    raise ValueError(f"stored model asks for engine {kind!r}; known: pytorch, {', '.join(TENSORRT_LLM_KINDS)}")
