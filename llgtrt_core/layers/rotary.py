"""Rotary position embeddings, and decode's step from the packed qkv projection to the KV cache
(Triton twin: rotary_triton.py)."""

from __future__ import annotations

from typing import Optional

import torch

from llgtrt_core.layers.layernorm import rms_norm


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., head_dim); cos/sin: float32, broadcastable to x, in Hugging Face's half-split layout.
    Rotates in float32 and rounds once to x's dtype."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def qkv_shape(qkv: torch.Tensor, key_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, kv_heads, head_dim) of a packed qkv row block and the cache it writes into:
    the one shape contract of both rope_write_kv implementations."""
    kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]
    return qkv.shape[0], qkv.shape[1] // head_dim - 2 * kv_heads, kv_heads, head_dim


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Decode's step between the qkv projection and attention, one token per row.

    qkv: (n, (heads + 2 * kv_heads) * head_dim), q then k then v; row i sits at positions[i] of
    the sequence whose blocks block_table[i] lists. cos/sin tables: float32 (max_positions,
    head_dim). Caches: one layer's (blocks, kv_heads, block_size, head_dim). With norm weights
    (Qwen3), q and k are RMS-normalized per head before the rotation. Writes rotated k and v into
    the caches at each row's position; returns rotated q (n, heads, head_dim).
    """
    n, heads, kv_heads, head_dim = qkv_shape(qkv, key_cache)
    q, k, v = qkv.view(n, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # (n, 1, head_dim)
    block_size = key_cache.shape[2]
    blocks = block_table[torch.arange(n, device=qkv.device), positions // block_size]
    offsets = positions % block_size
    key_cache[blocks, :, offsets] = apply_rope(k, cos, sin)
    value_cache[blocks, :, offsets] = v
    return apply_rope(q, cos, sin)
