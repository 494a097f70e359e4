"""Triton twin of linear.py for one row of activations against a dense weight with no more outputs
than inputs (a batch-1 decode step's o_proj and down_proj): there cuBLAS splits K and adds a
reduce kernel after each; this GEMV reads each output's whole row in one program. Wider weights
(q/k/v, gate/up, the lm_head), more rows, quantized or non-CUDA modules: the module itself
(measured: docs/benchmarks/engine.md, session 12)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

BLOCK_N, BLOCK_K, WARPS, STAGES = 4, 128, 8, 4


@triton.jit
def _gemv_kernel(x_ptr, weight_ptr, bias_ptr, out_ptr, N, K, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N-1 again (no mask in the loop) and are not stored.
    weight_rows = weight_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + cols).to(tl.float32)
            weight = tl.load(weight_rows + cols[None, :]).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
            weight = tl.load(weight_rows + cols[None, :], mask=cols[None, :] < K, other=0.0).to(tl.float32)
        acc += weight * x[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def runs_as_gemv(module: nn.Module, x: torch.Tensor) -> bool:
    """One row of x against a dense nn.Linear weight of its dtype, no wider than it is long."""
    weight = module.weight if isinstance(module, nn.Linear) else None
    return (weight is not None and weight.shape[0] <= weight.shape[1] == x.shape[-1] == x.numel()
            and weight.dtype == x.dtype and weight.is_contiguous() and x.is_contiguous())


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Same contract as linear.linear."""
    if not runs_as_gemv(module, x):
        return module(x)
    weight = module.weight
    n, k = weight.shape
    out = x.new_empty(*x.shape[:-1], n)
    bias = module.bias
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, weight, weight if bias is None else bias, out, n, k, HAS_BIAS=bias is not None, EVEN_K=k % BLOCK_K == 0,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS, num_stages=STAGES)
    return out
