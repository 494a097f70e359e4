"""Triton twin of attention.decode_attention: split-K "flash decoding" over the paged cache.

Each program takes one (row, kv head, key split): the GQA group's queries against a slice of
that row's keys, with an online softmax, leaving a partial output and its log-sum-exp; a second
kernel merges the splits. Keys are found through the row's block table, one block id per key
(a cached gather: a 64-key step touches 4 blocks of 16). Each row's length (positions[i] + 1) is read on the device, so the
launch shapes depend on the batch alone and a CUDA graph serves every length. The split count
is chosen per batch to give the GPU about two programs per SM.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner step
MAX_SPLITS = 32


@triton.jit
def _split_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, positions_ptr, partial_out_ptr, partial_lse_ptr,
    block_table_stride, cache_block_stride, cache_head_stride, cache_position_stride, scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(positions_ptr + row) + 1
    # Whole BLOCK_N steps per split, so short rows use few splits and leave the rest empty.
    split_len = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    group = tl.arange(0, GROUP_BLOCK)  # padded to 16 rows: tl.dot's minimum
    dims = tl.arange(0, DIM_BLOCK)
    heads = kv_head * GROUP + group
    group_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + dims[None, :],
                mask=group_mask[:, None] & dim_mask[None, :], other=0.0)
    table = block_table_ptr + row * block_table_stride
    head_offset = kv_head * cache_head_stride
    max_score = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_BLOCK], tl.float32)
    acc = tl.zeros([GROUP_BLOCK, DIM_BLOCK], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        keys_at = block_start + tl.arange(0, BLOCK_N)
        key_mask = keys_at < end
        blocks = tl.load(table + keys_at // BLOCK_SIZE, mask=key_mask, other=0)
        key_offsets = head_offset + blocks * cache_block_stride + (keys_at % BLOCK_SIZE) * cache_position_stride
        tile = key_offsets[:, None] + dims[None, :]
        tile_mask = key_mask[:, None] & dim_mask[None, :]
        k = tl.load(key_cache_ptr + tile, mask=tile_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # "ieee": no tf32 for float32
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, axis=1))
        p = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(max_score - new_max)
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + tile, mask=tile_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        max_score = new_max
    nonempty = total > 0
    out = acc / tl.where(nonempty, total, 1.0)[:, None]
    lse = tl.where(nonempty, max_score + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    partial = (row * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], out,
             mask=group_mask[:, None] & dim_mask[None, :])
    tl.store(partial_lse_ptr + partial, lse, mask=group_mask)


@triton.jit
def _merge_kernel(partial_out_ptr, partial_lse_ptr, out_ptr,
                  HEAD_DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr):
    row_head = tl.program_id(0).to(tl.int64)  # row * heads + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_BLOCK)
    dim_mask = dims < HEAD_DIM
    lse = tl.load(partial_lse_ptr + row_head * NUM_SPLITS + splits)
    weights = tl.exp(lse - tl.max(lse, axis=0))  # empty splits: exp(-inf) = 0; split 0 is never empty
    weights = weights / tl.sum(weights, axis=0)
    partial = tl.load(partial_out_ptr + (row_head * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=dim_mask[None, :], other=0.0)
    out = tl.sum(partial * weights[:, None], axis=0)
    tl.store(out_ptr + row_head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def split_count(programs: int, device: torch.device) -> int:
    """Key splits per (row, kv head): a power of two giving about two programs per SM."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 8
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(2 * sms, programs)))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    """Asked once per device: eager decode calls split_count in every layer of every step."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    positions: torch.Tensor, key_len: int,
) -> torch.Tensor:
    """Same contract as attention.decode_attention; key_len is not needed (lengths are read on the device)."""
    n, heads, head_dim = q.shape
    kv_heads = key_cache.shape[1]
    group = heads // kv_heads
    splits = split_count(n * kv_heads, q.device)
    partial_out = torch.empty(n, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
    dim_block = triton.next_power_of_2(head_dim)
    _split_kernel[(n, kv_heads, splits)](
        q, key_cache, value_cache, block_table, positions, partial_out, partial_lse,
        block_table.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), head_dim**-0.5,
        NUM_HEADS=heads, GROUP=group, GROUP_BLOCK=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_BLOCK=dim_block, BLOCK_N=BLOCK_N, NUM_SPLITS=splits, BLOCK_SIZE=key_cache.shape[2], num_warps=4,
    )
    out = q.new_empty(n, heads * head_dim)
    _merge_kernel[(n * heads,)](partial_out, partial_lse, out, HEAD_DIM=head_dim, DIM_BLOCK=dim_block,
                                NUM_SPLITS=splits, num_warps=4)
    return out
