"""Weight-only quantized linear layers for the CPU, activations in bfloat16: int8 (gpt-fast's
scheme, one scale per output channel) and int4 (groups of 32 input channels, a scale and a zero
each: the layout of llama.cpp's Q4_1 blocks, so a checkpoint dequantized from Q4_1 is held exactly).

A decode step is bound by reading the weights: `_weight_int8pack_mm` reads one byte per weight,
`_weight_int4pack_mm_for_cpu` half a byte, where a float32 matmul reads four. For many rows (a
prompt) those kernels are slower than oneDNN's bfloat16 GEMM, so each layer keeps a bfloat16 copy
of the *same* weights (the quantized values times their scales) for them: both paths compute one
model, whatever the batch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llgtrt_core.kernels import cpu_quant

INT4_GROUP = 32  # input channels per scale and zero, as in Q4_1
INT4_INNER_K_TILES = 1  # the packing the CPU kernel reads (any value; it repacks for its own tiles)
# Rows up to which our kernels (kernels/cpu_quant.py) beat the bfloat16 GEMM: 30 layers' int4
# projections at 32 rows took 22-31 ms against its 44 (docs/benchmarks/cpu.md, session 13).
VNNI_MAX_ROWS = 32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 weight (out, in), float32 scales (out,))."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
    return (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


class Int4Groups(NamedTuple):
    q: torch.Tensor  # (out, in) uint8, 0..15
    scales: torch.Tensor  # (out, in / INT4_GROUP) float32
    low: torch.Tensor  # the groups' minimums, as scales


def quantize_int4(weight: torch.Tensor) -> Int4Groups:
    """Asymmetric int4 per group of INT4_GROUP input channels, as llama.cpp's Q4_1: each group's
    scale is (max - min) / 15 and its values min + q * scale, q in 0..15."""
    groups = weight.float().unflatten(1, (-1, INT4_GROUP))
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    return Int4Groups(q.flatten(1).to(torch.uint8), scales, low)


def exact_int4_groups(weights: Sequence[torch.Tensor]) -> Optional[list[Int4Groups]]:
    """Each weight's int4 groups if they hold every weight without error (up to float32 rounding),
    as for a checkpoint dequantized from Q4_1 blocks; else None (found at the first that does not)."""
    exact = []
    for weight in weights:
        if weight.shape[1] % INT4_GROUP:
            return None
        groups = quantize_int4(weight.detach())
        scales = groups.scales.repeat_interleave(INT4_GROUP, 1)
        restored = groups.low.repeat_interleave(INT4_GROUP, 1) + groups.q * scales
        if float(((restored - weight.detach().float()).abs() / scales).max()) >= 1e-3:
            return None
        exact.append(groups)
    return exact


class WeightOnlyLinear(nn.Module):
    """A packed-weight kernel up to `max_rows` rows, oneDNN's GEMM on the dense copy beyond."""

    max_rows: int  # rows up to which the packed kernel beats the bfloat16 GEMM (docs/benchmarks/cpu.md)

    def __init__(self, dense_weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.register_buffer("dense_weight", dense_weight.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    @classmethod
    def of(cls, linear: nn.Linear, dtype: torch.dtype) -> "WeightOnlyLinear":
        return cls(linear.weight.detach(), linear.bias, dtype)  # a subclass's (weight, bias, dtype)

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _take_vnni(self, weight: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether this layer runs our kernels (`vnni`), which also take more rows; after __init__."""
        self.vnni = _vnni_fits(weight, dtype)
        if self.vnni:
            self.max_rows = VNNI_MAX_ROWS
        return self.vnni

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows:
            return F.linear(x, self.dense_weight, self.bias)
        out = self.packed_mm(x.reshape(rows, x.shape[-1]))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


class Int8Linear(WeightOnlyLinear):
    """On a CPU with AVX-512 VNNI our kernel (kernels/cpu_quant.py, the activations quantized to
    int8 per block of 32), elsewhere aten's."""

    max_rows = 4

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        int8_weight, scales = quantize_int8(weight)
        scales = scales.to(dtype)  # the kernel takes them in the activations' dtype: round them once, for both paths
        super().__init__(int8_weight.float() * scales.float()[:, None], bias, dtype)
        self.register_buffer("int8_weight", cpu_quant.pack_int8(int8_weight) if self._take_vnni(weight, dtype)
                             else int8_weight)
        self.register_buffer("scales", scales)

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            return cpu_quant.int8_mm(x, self.int8_weight, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.int8_weight, self.scales)


class Int4Linear(WeightOnlyLinear):
    """On a CPU with AVX-512 VNNI our kernel (kernels/cpu_quant.py: the activations quantized to
    int8 per block of 32, as llama.cpp does; scales and minimums in float16, as in Q4_1), which
    reads the weights 2.7x faster than aten's at 1 row and 3x at 8 (docs/benchmarks/cpu.md,
    session 13); elsewhere aten's int4 kernel."""

    # Out of cache (a whole model's layers in turn) int4 is 4x faster than the bfloat16 GEMM at
    # 1 row and still ahead at 8; at 16 rows the GEMM wins.
    max_rows = 12

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype,
                 groups: Optional[Int4Groups] = None):
        """groups: `weight`'s, when already quantized (`exact_int4_groups`)."""
        q, scales, low = groups if groups is not None else quantize_int4(weight)
        (self._init_vnni if _vnni_fits(q, dtype) else self._init_aten)(q, scales, low, bias, dtype)
        self._take_vnni(q, dtype)

    def _init_vnni(self, q: torch.Tensor, scales: torch.Tensor, low: torch.Tensor, bias: Optional[torch.Tensor],
                   dtype: torch.dtype) -> None:
        packed, scales16, mins16 = cpu_quant.pack_int4(q, scales, low)
        super().__init__(q * _per_input(scales.half()) + _per_input(low.half()), bias, dtype)  # as the kernel rounds them
        self.register_buffer("int4_weight", packed)
        self.register_buffer("scales", scales16)
        self.register_buffer("mins", mins16)

    def _init_aten(self, q: torch.Tensor, scales: torch.Tensor, low: torch.Tensor, bias: Optional[torch.Tensor],
                   dtype: torch.dtype) -> None:
        q = q.to(torch.int32)  # what the packing takes (and no uint8 wrap-around below)
        # The kernel computes (q - 8) * scale + zero, in the activations' dtype: rounded once, for both paths.
        scales_and_zeros = torch.stack([scales, low + 8 * scales], dim=-1).transpose(0, 1).to(dtype).contiguous()
        scales, zeros = (_per_input(part.transpose(0, 1)) for part in scales_and_zeros.unbind(-1))
        super().__init__((q - 8) * scales + zeros, bias, dtype)
        self.register_buffer("int4_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES))
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (in / INT4_GROUP, out, 2)

    def packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni:
            return cpu_quant.int4_mm(x, self.int4_weight, self.scales, self.mins)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.int4_weight, INT4_GROUP, self.scales_and_zeros)


def _vnni_fits(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether our kernels take this (out, in) weight: bfloat16 activations, whole groups of rows and
    blocks of inputs, on a CPU they run on."""
    return (dtype == torch.bfloat16 and weight.shape[0] % cpu_quant.ROWS_PER_GROUP == 0
            and weight.shape[1] % cpu_quant.BLOCK == 0 and cpu_quant.available())


def _per_input(group_values: torch.Tensor) -> torch.Tensor:
    """(out, in / INT4_GROUP) -> (out, in) float32: each group's value for each of its inputs."""
    return group_values.float().repeat_interleave(INT4_GROUP, 1)
