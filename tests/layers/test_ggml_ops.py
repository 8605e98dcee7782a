"""ggml_vec_dot_f16's summation order, vectorized in layers/ggml_ops.py, against a plain scalar loop written
from the same description: 4 accumulators x 8 f32 lanes over 32-value chunks, the fixed reduction tree,
then the n % 32 leftover products added one by one in f64. Head sizes that are not multiples of 32 (a
100-dim head: 3 chunks and 4 leftovers) take the leftover path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitserve.layers.ggml_ops import vec_dot_f16


def scalar_vec_dot_f16(x: np.ndarray, y: np.ndarray) -> np.float32:
    """x, y f32 [n] holding F16 values -> f32, one operation at a time."""
    n = len(x)
    whole = n - n % 32
    acc = np.zeros((4, 8), dtype=np.float32)
    for chunk in range(whole // 32):
        for j in range(4):
            for lane in range(8):
                i = 32 * chunk + 8 * j + lane
                acc[j, lane] = np.float32(acc[j, lane] + np.float32(x[i] * y[i]))
    pair = [
        np.float32(np.float32(acc[0, lane] + acc[2, lane]) + np.float32(acc[1, lane] + acc[3, lane]))
        for lane in range(8)
    ]
    half = [np.float32(pair[lane] + pair[lane + 4]) for lane in range(4)]
    total = np.float32(np.float32(half[0] + half[1]) + np.float32(half[2] + half[3]))
    if whole == n:
        return total
    wide = np.float64(total)
    for i in range(whole, n):
        wide = wide + np.float64(np.float32(x[i] * y[i]))
    return np.float32(wide)


@pytest.mark.parametrize("n", [32, 64, 100, 128, 37, 5])
def test_vec_dot_f16_matches_the_scalar_order(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=generator).to(torch.float16).to(torch.float32)  # F16 values
    y = torch.randn(6, n, generator=generator).to(torch.float16).to(torch.float32)
    got = vec_dot_f16(x, y)  # [6]
    expected = [scalar_vec_dot_f16(x[r].numpy(), y[r].numpy()) for r in range(6)]
    assert got.dtype == torch.float32
    assert got.tolist() == [float(value) for value in expected]
