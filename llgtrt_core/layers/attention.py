"""Decode attention: one query per row over its own cached keys (Triton twin: attention_triton.py)."""

from __future__ import annotations

import torch


def decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, positions: torch.Tensor, key_len: int
) -> torch.Tensor:
    """Grouped-query attention of row i's query over keys 0..positions[i] of cache slot i.

    q: (n, heads, head_dim); caches: one layer's (slots, kv_heads, capacity, head_dim);
    key_len >= max(positions) + 1 bounds the keys read, known to the caller without a device
    sync. Returns (n, heads * head_dim). Plain matmuls over a masked strided view of the cache:
    for a single query they beat SDPA's CPU kernel by an order of magnitude and copy nothing.
    """
    n, heads, head_dim = q.shape
    kv_heads = key_cache.shape[1]
    keys, values = key_cache[:n, :, :key_len], value_cache[:n, :, :key_len]
    mask = (torch.arange(key_len, device=q.device) <= positions[:, None])[:, None, None, :]
    grouped = q.view(n, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * head_dim**-0.5  # (n, kv_heads, group, key_len)
    scores = scores.float().masked_fill(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)  # (n, kv_heads, group, head_dim)
    return out.reshape(n, heads * head_dim)
