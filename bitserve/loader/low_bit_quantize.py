"""llama.cpp's 1- and 2-bit weight types written from float rows, bytes equal to ggml's reference
quantizers (quantize_row_q1_0_ref / quantize_row_q2_0_ref in ggml-quants.c), so a file bitserve writes
is the file llama.cpp would (tests/models/test_coverage_golden.py compares them byte for byte).

Q1_0, blocks of 128: d = (sum of |x| in index order, f32) / 128 stored as f16; bit j of qs[j / 8] (LSB
first) is 1 where x_j >= 0 (value +d) else 0 (-d).
Q2_0, blocks of 64: d = max |x| stored as f16; code j = clamp(roundf(x_j * (1 / d)) + 1, 0, 3) with the
f32 d, four codes a byte, value j at bits 2 (j % 4) of qs[j / 4]; codes decode to (code - 1) d.
"""

from __future__ import annotations

import numpy as np

from bitserve.loader.gguf_types import BLOCK_FORMATS, GGMLType

QK1_0, QK2_0 = BLOCK_FORMATS[GGMLType.Q1_0].block_size, BLOCK_FORMATS[GGMLType.Q2_0].block_size


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """f32 [M, K] -> [M * K / block, block]; K must be a whole number of blocks."""
    rows, cols = x.shape
    if cols % block:
        raise ValueError(f"rows of {cols} values are not a whole number of {block}-value blocks")
    return np.ascontiguousarray(x, dtype=np.float32).reshape(rows * cols // block, block)


def quantize_q1_0(x: np.ndarray) -> np.ndarray:
    """f32 [M, K] -> uint8 [M * K / 128 * 18]: Q1_0 blocks."""
    blocks = _blocks(x, QK1_0)
    # sequential f32 sum, as ggml's loop adds (np.add.accumulate keeps the order; .sum() pairs terms)
    sum_abs = np.add.accumulate(np.abs(blocks), axis=1, dtype=np.float32)[:, -1]
    d = (sum_abs / np.float32(QK1_0)).astype(np.float16)
    bits = (blocks >= 0).reshape(-1, QK1_0 // 8, 8)  # [N, 16, 8]: value 8i + b
    qs = np.packbits(bits, axis=2, bitorder="little").reshape(-1, QK1_0 // 8)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), qs], axis=1).reshape(-1)


def quantize_q2_0(x: np.ndarray) -> np.ndarray:
    """f32 [M, K] -> uint8 [M * K / 64 * 18]: Q2_0 blocks."""
    blocks = _blocks(x, QK2_0)
    d = np.abs(blocks).max(axis=1)  # f32 [N]
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    scaled = blocks * inverse[:, None]  # f32 products, as w * id in C
    # roundf, half away from zero: floor(|s|) plus one where the exact fraction |s| - floor(|s|) reaches
    # 0.5. (floor(|s| + 0.5) is not roundf: |s| = 0.49999997, the f32 product at w = -d / 2, sums to 1.0.)
    magnitude = np.abs(scaled)
    whole = np.floor(magnitude)
    rounded = np.sign(scaled) * (whole + (magnitude - whole >= np.float32(0.5)))
    codes = np.clip(rounded + 1, 0, 3).astype(np.uint8).reshape(-1, QK2_0 // 4, 4)  # value 4i + s
    qs = codes[:, :, 0] | codes[:, :, 1] << 2 | codes[:, :, 2] << 4 | codes[:, :, 3] << 6
    d16 = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return np.concatenate([d16, qs.astype(np.uint8)], axis=1).reshape(-1)


QUANTIZERS = {"Q1_0": quantize_q1_0, "Q2_0": quantize_q2_0}
