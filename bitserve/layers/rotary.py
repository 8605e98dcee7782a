"""Rotary position embedding in the two styles GGUF files use (docs/formats.md §4.2).

NEOX (rotate-half) pairs (x[i], x[i + d/2]): `bitnet*` files, HF `rotate_half`.
NORM (interleaved) pairs (x[2i], x[2i+1]): `llama` files, whose converters permuted q/k rows so that
NORM on the stored weights equals rotate-half on the HF weights.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from bitserve.kernels.backend import FusedOps
from bitserve.kernels.reference.ternary import fma_f32


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
        ggml_numerics: bool = False,
    ) -> None:
        super().__init__()
        # the backend's in-place kernel (bit-identical), when it has one; ggml numerics run eagerly
        self.fused = None if ggml_numerics else fused
        if rope_dim % 2:
            raise ValueError(f"rope dimension must be even, got {rope_dim}")
        self.rope_dim = rope_dim
        self.style = style
        self.ggml_numerics = ggml_numerics
        if ggml_numerics:
            cos, sin = ggml_rope_tables(rope_dim, base, max_positions, freq_factors, position_scale)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
            return
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
            self.fused.rotary_(
                q, k, positions, self.cos, self.sin, self.rope_dim, self.style is RopeStyle.NEOX
            )
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
        if self.ggml_numerics:
            # ggml's `x0*cos - x1*sin` / `x0*sin + x1*cos` as clang contracts them (-march=native):
            # the first product fused with the add, the second rounded on its own
            out_first = fma_f32(first, cos, -(second * sin))
            out_second = fma_f32(first, sin, second * cos)
        else:
            out_first = first * cos - second * sin
            out_second = first * sin + second * cos
        if self.style is RopeStyle.NEOX:
            rotated = torch.cat((out_first, out_second), dim=-1)
        else:
            rotated = torch.stack((out_first, out_second), dim=-1).flatten(-2)
        if rest.shape[-1] == 0:
            return rotated
        return torch.cat((rotated, rest), dim=-1)


@functools.cache
def _libm_f32(name: str) -> Callable[[float], float] | None:
    """The C library's float function `name` (cosf, sinf, powf), or None where there is no libm."""
    path = ctypes.util.find_library("m")
    if path is None:
        return None
    try:
        function = getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_float
    function.argtypes = [ctypes.c_float] * (2 if name == "powf" else 1)
    return function


def _f32_map(name: str, fallback: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """Apply libm's `name` to every f32 of x; without libm, the f64 function rounded to f32 (which
    differs from glibc's cosf / sinf in the last bit for about 1% of arguments)."""
    function = _libm_f32(name)
    if function is None:
        return fallback(x.astype(np.float64)).astype(np.float32)
    values = (function(v) for v in x.reshape(-1).tolist())
    return np.fromiter(values, dtype=np.float32, count=x.size).reshape(x.shape)


def ggml_rope_tables(
    rope_dim: int,
    base: float,
    max_positions: int,
    freq_factors: torch.Tensor | None = None,
    position_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin f32 [max_positions, rope_dim / 2] exactly as ggml's rope cache builds them.

    ggml (no YaRN): theta_scale = powf(base, -2.0f / n_dims); theta_0 = (float) pos, then
    theta_{i+1} = fl32(theta_i * theta_scale), a running f32 product (not base^(-2i/d) in f64); each
    pair's angle is fl32(freq_scale * fl32(theta_i / freq_factor_i)), and cos / sin are libm's cosf /
    sinf of that f32. Rounding differs from the f64 tables by up to a few f32 ulps of the angle.
    """
    powf = _libm_f32("powf")
    exponent = np.float32(-2.0) / np.float32(rope_dim)
    if powf is not None:
        theta_scale = np.float32(powf(base, exponent))
    else:
        theta_scale = np.float32(np.float64(base) ** np.float64(exponent))
    num_pairs = rope_dim // 2
    theta = np.empty((max_positions, num_pairs), dtype=np.float32)
    theta[:, 0] = np.arange(max_positions, dtype=np.float32)
    for i in range(1, num_pairs):
        theta[:, i] = theta[:, i - 1] * theta_scale  # f32 * f32 -> f32, one rounding
    if freq_factors is not None:
        theta = theta / freq_factors.to(torch.float32).reshape(-1)[:num_pairs].numpy()
    theta = (np.float32(position_scale) * theta).astype(np.float32)
    cos = _f32_map("cosf", np.cos, theta)
    sin = _f32_map("sinf", np.sin, theta)
    return torch.from_numpy(cos), torch.from_numpy(sin)
