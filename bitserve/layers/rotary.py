"""Rotary position embedding in the two styles GGUF files use (docs/formats.md §4.2).

NEOX (rotate-half) pairs (x[i], x[i + d/2]): `bitnet*` files, HF `rotate_half`.
NORM (interleaved) pairs (x[2i], x[2i+1]): `llama` files, whose converters permuted q/k rows so that
NORM on the stored weights equals rotate-half on the HF weights.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from bitserve.kernels.backend import FusedOps


class RopeStyle(enum.Enum):
    NEOX = "neox"
    NORM = "norm"


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim].

    Only the first `rope_dim` dims of each head rotate (partial rotary); the rest pass through.
    `freq_factors` (Llama-3 `rope_freqs`) divide each pair's frequency; `position_scale` is linear
    rope scaling (positions are multiplied by it).
    """

    def __init__(
        self,
        rope_dim: int,
        base: float,
        max_positions: int,
        style: RopeStyle,
        freq_factors: torch.Tensor | None = None,
        position_scale: float = 1.0,
        fused: FusedOps | None = None,
    ) -> None:
        super().__init__()
        self.fused = fused  # the backend's in-place kernel (bit-identical), when it has one
        if rope_dim % 2:
            raise ValueError(f"rope dimension must be even, got {rope_dim}")
        self.rope_dim = rope_dim
        self.style = style
        pair_ids = torch.arange(rope_dim // 2, dtype=torch.float64)
        inv_freq = base ** (-2.0 * pair_ids / rope_dim)  # [rope_dim / 2]
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64).reshape(-1)[: rope_dim // 2]
        positions = torch.arange(max_positions, dtype=torch.float64) * position_scale
        angles = torch.outer(positions, inv_freq)  # [max_positions, rope_dim / 2]
        self.register_buffer("cos", angles.cos().to(torch.float32), persistent=False)
        self.register_buffer("sin", angles.sin().to(torch.float32), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and q.dtype == k.dtype == torch.float32:
            # NOTE: in place: q and k are fresh projection outputs that nothing else holds (column
            # slices of a stacked q/k/v output when num_tokens > 1: made contiguous, a small copy)
            q, k = q.contiguous(), k.contiguous()
            self.fused.rotary_(q, k, positions, self.cos, self.sin, self.rope_dim, self.style is RopeStyle.NEOX)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, rope_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        if self.style is RopeStyle.NEOX:
            first, second = rot.chunk(2, dim=-1)  # each [num_tokens, heads, rope_dim / 2]
        else:
            first, second = rot[..., 0::2], rot[..., 1::2]
        out_first = first * cos - second * sin
        out_second = first * sin + second * cos
        if self.style is RopeStyle.NEOX:
            rotated = torch.cat((out_first, out_second), dim=-1)
        else:
            rotated = torch.stack((out_first, out_second), dim=-1).flatten(-2)
        if rest.shape[-1] == 0:
            return rotated
        return torch.cat((rotated, rest), dim=-1)
