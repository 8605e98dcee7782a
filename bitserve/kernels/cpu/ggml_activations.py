"""llama.cpp's own activation rounding for block weights (block_activations="ggml"): the exact mode of the
int8 tile, for crossval against llama.cpp rather than for speed.

ggml quantizes a matmul's input to its weight type's `vec_dot_type` (ggml-cpu.c's type traits) and the
int8 tile (kernels/cpu/interleaved.py) multiplies whatever int8 codes and per-32-value scales it is
given, so each family below is a different (q, dx, sx) for the same kernels:
- Q8_0 (Q4_0, Q5_0, Q8_0, Q2_0, Q1_0 weights): the codes of quantize_block_q8 (x86 quantize_row_q8_0:
  round_half_even(x * 127 / amax)), their scale d = amax / 127 rounded to f16 as block_q8_0 stores it;
  sx = d16 * sum(q), which makes the tile's min term the integer offset ggml folds into its dot.
- Q8_1 (Q4_1, Q5_1): the same codes and f16 d, and s = f16(d * sum(q)) as block_q8_1 stores it (f32 d).
- Q8_K (Q2_K, Q4_K, Q5_K, Q6_K; x86 quantize_row_q8_K is the reference quantize_row_q8_K_ref): one scale per
  256 values, d = 1 / fl32(-127 / max) for the signed max, q = min(127, round_half_even(x / d))
  (kernels/reference/ternary.quantize_q8k, the TQ formats' ggml mode); every 32-value block of a
  super-block gets that d, and sx = d * sum(q) over the 32 values (ggml's bsums, as the min term reads
  them).
The integer dots are exact either way; what differs from ggml is only the f32 summation order of the
epilogue (a few ulp), against the per-32 f32 scales of the default "q8" mode (which round the K-quants'
inputs 8x finer than ggml does, and leave dx unrounded).
"""

from __future__ import annotations

import numpy as np
import torch

from bitserve.kernels.cpu.blockdot import quantize_block_q8
from bitserve.kernels.cpu.interleaved import (
    KIND_Q2_K,
    KIND_Q4_1,
    KIND_Q4_K,
    KIND_Q5_1,
    KIND_Q5_K,
    KIND_Q6_K,
    QK,
)
from bitserve.kernels.reference.ternary import quantize_q8k

Q8_0, Q8_1, Q8_K = "q8_0", "q8_1", "q8_k"  # ggml's vec_dot_type of each weight kind
SUPER_BLOCK = 256


def activation_family(kind: int) -> str:
    """The ggml block type a weight of `kind` (interleaved.KIND_*) meets its input in."""
    if kind in (KIND_Q2_K, KIND_Q4_K, KIND_Q5_K, KIND_Q6_K):
        return Q8_K
    if kind in (KIND_Q4_1, KIND_Q5_1):
        return Q8_1
    return Q8_0


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)


def quantize_ggml(
    x: np.ndarray, padded_tokens: int, family: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32 [T, K] -> (q int8 [padded_tokens, K], dx f32 [padded_tokens, K / 32], sx likewise), zero rows
    as padding: the tile's inputs for `family` (see the module docstring)."""
    if family == Q8_K:
        return _quantize_q8_k(x, padded_tokens)
    q, dx, sx = quantize_block_q8(x, padded_tokens)
    sums = q.reshape(q.shape[0], -1, QK).astype(np.int32).sum(axis=2).astype(np.float32)  # [Tp, nb]
    if family == Q8_1:
        return q, _f16(dx), _f16(dx * sums)
    d16 = _f16(dx)
    return q, d16, d16 * sums


def _quantize_q8_k(x: np.ndarray, padded_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    num_tokens, num_cols = x.shape
    if num_cols % SUPER_BLOCK:
        raise ValueError(f"Q8_K activations need K a multiple of {SUPER_BLOCK}, got {num_cols}")
    codes, d = quantize_q8k(torch.from_numpy(x))  # int8 [T, K], f32 [T, K / 256]
    q = np.zeros((padded_tokens, num_cols), dtype=np.int8)
    q[:num_tokens] = codes.numpy()
    dx = np.zeros((padded_tokens, num_cols // QK), dtype=np.float32)
    dx[:num_tokens] = np.repeat(d.numpy(), SUPER_BLOCK // QK, axis=1)
    sums = q.reshape(padded_tokens, -1, QK).astype(np.int32).sum(axis=2).astype(np.float32)
    return q, dx, dx * sums
