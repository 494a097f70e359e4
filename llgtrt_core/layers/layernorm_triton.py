"""Triton twin of layernorm.py: residual add + RMSNorm in one pass over each row."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Rounded to the dtype before normalizing, as the unfused `residual + x` would be.
        residual = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normalized = (x32 * inverse_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (normalized * weight).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as layernorm.add_rms_norm (x and residual contiguous)."""
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(x.numel() // hidden,)](
        x, x if residual is None else residual, weight, out, hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
    )
    return out, x if residual is None else residual
