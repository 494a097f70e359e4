"""Reference / fallback bitmask apply in plain vectorized torch (any device).

Same semantics as the CUDA kernel: bit t%32 of word t//32 set = token t allowed; every other
logit, and every logit at or past 32 * mask width, becomes -inf. Only the rows named are touched.
"""

from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, W) int32 words -> (N, min(vocab_size, 32 * W)) bool, True = allowed."""
    covered = min(vocab_size, 32 * bitmask.shape[1])
    words = bitmask[:, : (covered + 31) // 32]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    # Arithmetic shift is fine: `& 1` keeps only the bit asked for, sign bit included.
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :covered].bool()


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[torch.Tensor] = None
) -> None:
    """`rows` (int64, on logits' device, distinct) maps mask row j to logits row rows[j]; a
    negative one to none (its mask is skipped, as the CUDA kernel does)."""
    if rows is not None and bool((rows < 0).any()):
        kept = rows >= 0
        bitmask, rows = bitmask[kept.to(bitmask.device)], rows[kept]
        if not len(rows):
            return
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    covered = allowed.shape[1]
    if rows is None:
        logits[:, :covered].masked_fill_(~allowed, NEG_INF)
        logits[:, covered:] = NEG_INF
        return
    selected = logits.index_select(0, rows)
    selected[:, :covered].masked_fill_(~allowed, NEG_INF)
    selected[:, covered:] = NEG_INF
    logits.index_copy_(0, rows, selected)
