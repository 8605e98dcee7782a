"""Reference dense linear: f32 weights (block formats are dequantized at load) times f32 activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_dense_weight(weight: torch.Tensor) -> tuple[int, int]:
    """Validate a dense weight (float32 [M, K]) and return (M, K)."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"dense weights must be float32 [M, K], got {weight.dtype} {tuple(weight.shape)}")
    return weight.shape[0], weight.shape[1]


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x f32 [T, K], weight f32 [M, K] -> f32 [T, M] in fp32 (torch's BLAS; summation order is its own)."""
    return F.linear(x, weight)
