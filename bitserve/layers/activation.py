"""Gated FFN activations: SiLU-and-mul (Llama, upstream `bitnet`) and squared ReLU (BitNet b1.58)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def relu2_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.relu(gate).square() * up


def gelu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "relu2": relu2_and_mul,
    "relu_sqr": relu2_and_mul,
    "gelu": gelu_and_mul,
}
