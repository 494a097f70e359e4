"""Constrained sampling fused into one pass: mask + temperature + sample (or argmax).

Per row, the token is argmax over allowed tokens of logit / T + Gumbel noise, an exact sample
of softmax(logit / T) restricted to the allowed tokens (T = 0: plain argmax). The noise is a
counter-based hash of (row seed, token id), so a row's sample depends only on its seed and
logits, never on the batch around it, and the CUDA kernel (csrc/masked_sampling.cu) and the
torch path below draw the same tokens. Logits are only read, never written.

top-k / top-p are not fused: rows that need them go through masking
(`apply_token_bitmask_inplace`) and the engine's sort-based sampler.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Union

import torch

from llgtrt_core.kernels import RowIndices, _row_tensor, cuda_kernel_available
from llgtrt_core.kernels.bitmask_torch import apply_token_bitmask_inplace_torch
from llgtrt_core.kernels.cuda_ext import load_extension

PerRow = Union[torch.Tensor, Sequence[float], Sequence[int]]

_LOW32 = 0xFFFFFFFF


def sample_with_bitmask(
    logits: torch.Tensor,
    temperature: PerRow,
    seeds: Optional[PerRow] = None,
    bitmask: Optional[torch.Tensor] = None,
    rows: Optional[RowIndices] = None,
    stream: Optional[torch.cuda.Stream] = None,
) -> torch.Tensor:
    """(B,) int64 token ids, one per logits row.

    logits: (B, V) f32/f16/bf16. temperature: (B,) (0 = greedy). seeds: (B,) int64 (advance them
    every step, e.g. request seed + step; None = all 0). bitmask / rows: as in
    `apply_token_bitmask_inplace`; rows without a mask row sample from every token.
    """
    batch = logits.shape[0]
    device = logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32).to(device, non_blocking=True)
    seeds = torch.zeros(batch, dtype=torch.int64) if seeds is None else torch.as_tensor(seeds, dtype=torch.int64)
    seeds = seeds.to(device, non_blocking=True)
    if temperature.shape != (batch,) or seeds.shape != (batch,):
        raise ValueError(f"temperature and seeds must have shape ({batch},)")
    row_index = _row_tensor(rows, device)
    if bitmask is not None:
        bitmask = bitmask.to(device, non_blocking=True)
        expected = batch if row_index is None else row_index.shape[0]
        if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[0] != expected:
            raise ValueError(f"bitmask must be int32 with {expected} rows")

    on_stream = torch.cuda.stream(stream) if stream is not None and logits.is_cuda else contextlib.nullcontext()
    with on_stream:
        if logits.is_cuda and logits.stride(1) == 1 and cuda_kernel_available():
            if bitmask is not None and bitmask.stride(1) != 1:
                bitmask = bitmask.contiguous()
            return load_extension().sample_with_bitmask(logits, temperature, seeds, bitmask, row_index)
        return sample_with_bitmask_torch(logits, temperature, seeds, bitmask, row_index)


def sample_with_bitmask_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    bitmask: Optional[torch.Tensor],
    rows: Optional[torch.Tensor],
) -> torch.Tensor:
    """The same function in plain torch (any device); the reference of the CUDA kernel. (One
    corner differs: when every allowed logit is -inf the kernel returns the first allowed token,
    this path token 0.)"""
    scores = logits.to(torch.float32, copy=True)
    if bitmask is not None:
        apply_token_bitmask_inplace_torch(scores, bitmask, rows)
    greedy = temperature == 0
    divisor = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    noisy = scores / divisor + gumbel_noise(seeds, logits.shape[1])
    return torch.where(greedy[:, None], scores, noisy).argmax(dim=-1)


def gumbel_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) float32 Gumbel(0, 1) noise, bit for bit the kernel's `gumbel(row_key(seed), t)`."""
    low = seeds & _LOW32
    high = (seeds >> 32) & _LOW32
    key = _lowbias32(low ^ _lowbias32(high))[:, None]
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    h = _lowbias32((_lowbias32(tokens ^ key) + key) & _LOW32)
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap; the mask keeps 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _LOW32
    return x ^ (x >> 16)
