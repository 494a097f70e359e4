"""Weight-only int8 linear layers for the CPU (gpt-fast's scheme: int8 weights, one scale per
output channel, activations in bfloat16).

A decode step is bound by reading the weights: `_weight_int8pack_mm` reads one byte per weight
where a float32 matmul reads four. For many rows (a prompt) that kernel is 5-10x slower than
oneDNN's bfloat16 GEMM, so the layer keeps a bfloat16 copy of the *same* weights (the int8
values times their scales) for them: both paths compute one model, whatever the batch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Rows up to which the int8 kernel beats the bfloat16 GEMM on an AVX-512 CPU (docs/benchmarks/cpu.md).
INT8_MAX_ROWS = 4


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 weight (out, in), float32 scales (out,))."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        super().__init__()
        int8_weight, scales = quantize_int8(weight)
        scales = scales.to(dtype)  # the kernel takes them in the activations' dtype: round them once, for both paths
        self.register_buffer("int8_weight", int8_weight)
        self.register_buffer("scales", scales)
        self.register_buffer("dense_weight", (int8_weight.float() * scales.float()[:, None]).to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    @classmethod
    def of(cls, linear: nn.Linear, dtype: torch.dtype) -> "Int8Linear":
        return cls(linear.weight.detach(), linear.bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > INT8_MAX_ROWS:
            return F.linear(x, self.dense_weight, self.bias)
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, x.shape[-1]), self.int8_weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])
