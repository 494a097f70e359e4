"""A projection of activations x by a linear module (Triton twin: linear_triton.py)."""

from __future__ import annotations

import torch
from torch import nn


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x): nn.Linear, or a quantized linear on the CPU."""
    return module(x)
