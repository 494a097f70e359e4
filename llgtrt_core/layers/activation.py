"""SiLU(gate) * up over the packed gate_up projection (Triton twin: activation_triton.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (..., 2 * size), gate first; returns (..., size)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
