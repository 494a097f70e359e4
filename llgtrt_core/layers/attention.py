"""Decode attention over the paged KV cache: one query per row over its own cached keys (Triton
twin: attention_triton.py). Cache layout: `llgtrt_core.engine.kv_cache`."""

from __future__ import annotations

import torch


def gather_blocks(layer_cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions stored in `blocks` (..., num) of one layer's cache
    (blocks, kv_heads, block_size, head_dim), in order: (..., kv_heads, length, head_dim)."""
    # index_select, not layer_cache[blocks]: the CPU's advanced indexing took 8x longer for the same copy.
    tiles = layer_cache.index_select(0, blocks.reshape(-1)).view(*blocks.shape, *layer_cache.shape[1:])
    tiles = tiles.transpose(-4, -3)  # (..., kv_heads, num, block_size, head_dim)
    return tiles.flatten(-3, -2)[..., :length, :]


def decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    positions: torch.Tensor, key_len: int,
) -> torch.Tensor:
    """Grouped-query attention of row i's query over keys 0..positions[i] of the sequence whose
    blocks block_table[i] lists.

    q: (n, heads, head_dim); caches: one layer's (blocks, kv_heads, block_size, head_dim);
    block_table: (>= n, max_blocks) int64. key_len >= max(positions) + 1 bounds the keys read,
    known to the caller without a device sync. Returns (n, heads * head_dim). Plain matmuls over
    the gathered keys: for a single query they beat SDPA's CPU kernel by an order of magnitude.
    """
    n, heads, head_dim = q.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    blocks = block_table[:n, : -(-key_len // block_size)]
    # Whole blocks: the keys past a row's position are masked anyway, and one shape per block
    # count keeps a compiled step (engine/compiled_decode.py) from specializing on ragged ends.
    key_len = blocks.shape[1] * block_size
    # float32 throughout: the CPU's bfloat16 matmuls take 3-5x longer at these sizes (a query row
    # per head group), and the output is rounded once.
    keys = gather_blocks(key_cache, blocks, key_len).float()
    values = gather_blocks(value_cache, blocks, key_len).float()
    mask = (torch.arange(key_len, device=q.device) <= positions[:, None])[:, None, None, :]
    grouped = q.float().view(n, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * head_dim**-0.5  # (n, kv_heads, group, key_len)
    out = torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), values)  # (n, kv_heads, group, head_dim)
    return out.to(q.dtype).reshape(n, heads * head_dim)
