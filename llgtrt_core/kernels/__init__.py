"""Apply llguidance token bitmasks to logits: a CUDA kernel, with a torch fallback.
(Masking fused with sampling: `llgtrt_core.kernels.sampling.sample_with_bitmask`; the loop guard's
narrowing of masks near their length limit, on CUDA: `narrow_to_endings`.)

Masked logits become -inf, as in llguidance and XGrammar (llgtrt writes the dtype's lowest
finite value instead). -inf makes a disallowed token's probability exactly 0 under any
temperature and composes with top-k/top-p code that marks removed tokens with -inf; a row with
every token disallowed would give NaN probabilities, which llguidance never produces (a stopped
or failed matcher still allows EOS).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Optional, Sequence, Union

import numpy as np
import torch

from llgtrt_core.kernels.bitmask_torch import apply_token_bitmask_inplace_torch
from llgtrt_core.kernels.cuda_ext import KernelUnavailable, load_extension

__all__ = ["apply_token_bitmask_inplace", "cuda_kernel_available", "narrow_to_endings", "KernelUnavailable"]

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

RowIndices = Union[torch.Tensor, Sequence[int]]


@functools.cache
def cuda_kernel_available() -> bool:
    """True when CUDA is usable and the extension builds or loads (the torch path is used otherwise)."""
    if not torch.cuda.is_available():
        return False
    try:
        load_extension()
    except KernelUnavailable as error:
        logger.warning("CUDA mask kernel unavailable, using the torch fallback: %s", error)
        return False
    return True


def apply_token_bitmask_inplace(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: Optional[RowIndices] = None,
    stream: Optional[torch.cuda.Stream] = None,
) -> None:
    """Set every disallowed logit to -inf, in place.

    logits: (B, V) float32/float16/bfloat16, any strides. bitmask: (N, W) int32, bit t%32 of word
    t//32 set = token t allowed; tokens >= 32 * W are disallowed. Mask row j applies to logits
    row rows[j] (distinct indices), or to row j when rows is None (then N == B). Other rows are
    untouched. On CUDA the work is enqueued on `stream` (e.g. a TensorRT-LLM
    `torch.cuda.ExternalStream`) or the current stream, with no host synchronisation.
    """
    if logits.dim() != 2 or logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"logits must be 2-D float32/float16/bfloat16, got {logits.dtype} {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be 2-D int32, got {bitmask.dtype} {tuple(bitmask.shape)}")
    expected_rows = logits.shape[0] if rows is None else len(rows)
    if bitmask.shape[0] != expected_rows:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, expected {expected_rows}")
    if rows is not None and not isinstance(rows, torch.Tensor):
        if any(not 0 <= r < logits.shape[0] for r in rows):
            raise IndexError(f"row index out of range for {logits.shape[0]} logits rows")

    on_stream = torch.cuda.stream(stream) if stream is not None and logits.is_cuda else contextlib.nullcontext()
    with on_stream:
        if logits.is_cuda and cuda_kernel_available():
            _apply_cuda(logits, bitmask, rows)
        else:
            apply_token_bitmask_inplace_torch(logits, bitmask, _row_tensor(rows, logits.device))


def narrow_to_endings(masks: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, string_classes: int) -> None:
    """The loop guard's narrowing of the mask rows `positions` (near their length limit) on CUDA,
    in place, queued on the current stream (`EscapeMasks.ending_tables` says what `tables` and
    `string_classes` hold). Needs the extension (`cuda_kernel_available`)."""
    load_extension().narrow_to_endings(masks, positions, tables, string_classes)


def _apply_cuda(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[RowIndices]) -> None:
    if not bitmask.is_cuda:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    load_extension().apply_token_bitmask_inplace(logits, bitmask, _row_tensor(rows, logits.device))


def _row_tensor(rows: Optional[RowIndices], device: torch.device) -> Optional[torch.Tensor]:
    """Row indices as a contiguous int64 tensor on `device`."""
    if rows is None:
        return None
    if isinstance(rows, torch.Tensor):
        return rows.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    return int64_to_device(rows, device)


def int64_to_device(values: Union[Sequence[int], np.ndarray], device: torch.device) -> torch.Tensor:
    """Host ints (a list, or an array) as a new int64 tensor on `device`; on CUDA through pinned
    memory, so the copy is asynchronous on the current stream (a pageable copy waits for the work
    already queued). Through numpy: torch.tensor reads a list of ints ~3x slower, and the engine
    thread uploads a few thousand a step (block-table rows) under the GIL."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)

