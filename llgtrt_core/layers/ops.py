"""The two implementations of the layer ops as sets: plain torch (CPU, and the reference) and
Triton kernels (CUDA, when triton is installed: CPU-only torch builds come without it)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from typing import Callable, Optional

import torch

from llgtrt_core.layers import activation, attention, layernorm, linear, rotary


@dataclass(frozen=True)
class LayerOps:
    add_rms_norm: Callable  # layernorm.add_rms_norm
    silu_mul: Callable  # activation.silu_mul
    rope_write_kv: Callable  # rotary.rope_write_kv
    decode_attention: Callable  # attention.decode_attention
    linear: Callable  # linear.linear


TORCH_OPS = LayerOps(layernorm.add_rms_norm, activation.silu_mul, rotary.rope_write_kv, attention.decode_attention,
                     linear.linear)


def _triton_ops() -> Optional[LayerOps]:
    if find_spec("triton") is None:
        return None
    from llgtrt_core.layers import activation_triton, attention_triton, layernorm_triton, linear_triton, rotary_triton

    return LayerOps(layernorm_triton.add_rms_norm, activation_triton.silu_mul, rotary_triton.rope_write_kv,
                    attention_triton.decode_attention, linear_triton.linear)


TRITON_OPS = _triton_ops()


def layer_ops(device: torch.device, fused: bool = True) -> LayerOps:
    """Triton kernels on CUDA unless `fused` is off; the torch ops everywhere else."""
    if fused and device.type == "cuda" and TRITON_OPS is not None:
        return TRITON_OPS
    return TORCH_OPS
