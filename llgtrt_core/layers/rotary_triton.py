"""Triton twin of rotary.rope_write_kv: one program per (row, head) of the packed qkv output."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from llgtrt_core.layers.rotary import qkv_shape


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr,
    q_norm_ptr, k_norm_ptr,
    qkv_row_stride, table_row_stride, block_table_stride, cache_block_stride, cache_head_stride,
    cache_position_stride, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    position = tl.load(positions_ptr + row)
    block = tl.load(block_table_ptr + row * block_table_stride + position // BLOCK_SIZE)
    # Where this row's key/value heads go: its block, at the position's offset in it.
    cache_offset = block * cache_block_stride + (position % BLOCK_SIZE) * cache_position_stride
    half = HEAD_DIM // 2
    offsets = tl.arange(0, HALF_BLOCK)
    mask = offsets < half
    source = qkv_ptr + row * qkv_row_stride + head * HEAD_DIM
    x1 = tl.load(source + offsets, mask=mask, other=0.0)
    x2 = tl.load(source + half + offsets, mask=mask, other=0.0)
    if head >= NUM_HEADS + NUM_KV_HEADS:  # a value head: copied into the cache as is
        kv_head = head - NUM_HEADS - NUM_KV_HEADS
        target = value_cache_ptr + cache_offset + kv_head * cache_head_stride
        tl.store(target + offsets, x1, mask=mask)
        tl.store(target + half + offsets, x2, mask=mask)
    else:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if QK_NORM:  # per-head RMSNorm in rms_norm's order: float32, round, scale
            if head < NUM_HEADS:
                norm_ptr = q_norm_ptr
            else:
                norm_ptr = k_norm_ptr
            inverse_rms = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / HEAD_DIM + eps)
            w1 = tl.load(norm_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(norm_ptr + half + offsets, mask=mask, other=0.0).to(tl.float32)
            a = ((a * inverse_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
            b = ((b * inverse_rms).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
        table = position * table_row_stride
        cos1 = tl.load(cos_ptr + table + offsets, mask=mask, other=0.0)
        cos2 = tl.load(cos_ptr + table + half + offsets, mask=mask, other=0.0)
        sin1 = tl.load(sin_ptr + table + offsets, mask=mask, other=0.0)
        sin2 = tl.load(sin_ptr + table + half + offsets, mask=mask, other=0.0)
        out1 = (a * cos1 - b * sin1).to(x1.dtype)
        out2 = (b * cos2 + a * sin2).to(x1.dtype)
        if head < NUM_HEADS:
            target = q_out_ptr + row * NUM_HEADS * HEAD_DIM + head * HEAD_DIM
        else:
            target = key_cache_ptr + cache_offset + (head - NUM_HEADS) * cache_head_stride
        tl.store(target + offsets, out1, mask=mask)
        tl.store(target + half + offsets, out2, mask=mask)


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
    """Same contract as rotary.rope_write_kv (qkv rows and the tables contiguous in their last dim)."""
    n, heads, kv_heads, head_dim = qkv_shape(qkv, key_cache)
    q = qkv.new_empty(n, heads, head_dim)
    qk_norm = q_norm_weight is not None
    _rope_write_kv_kernel[(n, heads + 2 * kv_heads)](
        qkv, positions, cos_table, sin_table, q, key_cache, value_cache, block_table,
        q_norm_weight if qk_norm else qkv, k_norm_weight if qk_norm else qkv,  # unread without QK_NORM
        qkv.stride(0), cos_table.stride(0), block_table.stride(0), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), eps,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
        BLOCK_SIZE=key_cache.shape[2], QK_NORM=qk_norm, num_warps=1,
    )
    return q
