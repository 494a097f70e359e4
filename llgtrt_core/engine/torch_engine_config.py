"""The embedded PyTorch engine's settings (`runtime.*` of the server's config, factory.py), each
`resolve_*` turning a default (None) into the value for the device the engine runs on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from llgtrt_core.engine.kv_cache import CUDA_MEMORY_FRACTION


@dataclass(frozen=True)
class TorchEngineConfig:
    max_batch_size: int = 8
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    device: Optional[str] = None  # default: cuda when available, else cpu
    dtype: Optional[str] = None  # default: bfloat16 on cuda and on a cpu with bfloat16 kernels, else float32
    # "int8" or "int4" (weight-only, cpu) or "dense"; default on cpu in bfloat16: int4 when the checkpoint
    # holds in int4 exactly (dequantized from Q4_1, the default model), else int8
    weights: Optional[str] = None
    cpu_threads: Optional[int] = None  # torch intra-op threads on cpu; default: all cores but one
    cpu_compile: Optional[bool] = None  # compiled decode layers on cpu (compiled_decode.py); default: with int8/int4
    cpu_gemm_templates: bool = True  # with aten's quantized matmuls: the compiled step's weights frozen, GEMM templates
    cpu_prompt_threads: Optional[int] = None  # a prompt-only step's threads while cores idle; default: all; 0: off
    cpu_kernel_threads: Optional[int] = None  # threads our cpu kernels share while cores idle; default: all cores
    cuda_graphs: bool = True  # decode under CUDA graphs (cuda only)
    # cuda: a step's draw waits for its masks on the device, where the driver can (constraint_stage.py)
    device_waits_for_masks: bool = True
    fast_forward: bool = True  # feed the tokens a grammar forces in one forward pass, unsampled
    prefill_chunk_tokens: Optional[int] = None  # prompt tokens prefilled per step; None or 0: whole prompts
    mixed_prefill: bool = True  # decode and the step's prompts in one forward pass (model_runner.py)
    kv_cache_free_gpu_memory_fraction: float = CUDA_MEMORY_FRACTION  # of the memory free once the weights are loaded
    kv_cache_max_tokens: Optional[int] = None  # caps the KV cache; on cpu it fixes its size (else it grows)
    prefix_caching: bool = True  # share the KV blocks of cached prompt prefixes (block_manager.py)
    # Queue the next decode before reading a step's tokens (see the module doc); default: on cuda,
    # where the host work then hides behind the GPU's. On cpu nothing runs ahead, so it only costs.
    overlap_steps: Optional[bool] = None

    def resolve_overlap_steps(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.overlap_steps is None else self.overlap_steps

    def resolve_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype:
            return getattr(torch, self.dtype)
        if device.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX-512 BF16 or AMX
            return torch.bfloat16
        return torch.float32

    def resolve_weights(self, device: torch.device) -> str:
        """The loader's `weights`: int8/int4 matmuls read a quarter/an eighth of float32's bytes per
        decode step, but the CPU kernels are fast only on bfloat16 activations
        (docs/benchmarks/cpu.md); the GPU path stays dense."""
        if self.weights is None:
            return "auto" if device.type == "cpu" and self.resolve_dtype(device) == torch.bfloat16 else "dense"
        if self.weights != "dense" and device.type != "cpu":
            raise ValueError(f"{self.weights} weights run on the cpu only")
        return self.weights

    def resolve_cpu_compile(self, device: torch.device) -> bool:
        """On for the CPU default (int8 or int4 weights), whose compiled step is tested against the
        eager one (tests/test_compiled_decode.py); never on cuda (CUDA graphs)."""
        if device.type != "cpu":
            return False
        return self.resolve_weights(device) != "dense" if self.cpu_compile is None else self.cpu_compile

    def resolve_cpu_threads(self) -> int:
        """One core is left to the rest of the server (event loop, HTTP, the grammar threads that
        fill masks while the forward pass runs): an OpenMP team stalls at every op while one of its
        threads waits for a core, which made 2-thread decode 3-7x slower than 1 thread on a busy
        2-core machine (docs/benchmarks/engine.md)."""
        return self.cpu_threads or max(1, usable_cores() - 1)

    def resolve_cpu_head_threads(self) -> int:
        """The lm_head alone runs on every core (LlamaForCausalLM.logits): it is a fifth of a decode
        step's bytes and one OpenMP region a step, where the layers are ~120."""
        return max(usable_cores(), self.resolve_cpu_threads())

    def resolve_cpu_kernel_threads(self) -> int:
        """Our quantized matmuls share a step's work among every core while they are idle
        (engine/kernel_threads.py)."""
        return self.cpu_kernel_threads or usable_cores()

    def resolve_cpu_prompt_threads(self) -> int:
        """A step that only prefills 5-12 tokens runs on every core while they are idle: nothing
        decodes then, and the API process waits for the first token (CompiledDecode.prompt_stance)."""
        return usable_cores() if self.cpu_prompt_threads is None else self.cpu_prompt_threads


def usable_cores() -> int:
    """CPUs this process may run on (a container's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
