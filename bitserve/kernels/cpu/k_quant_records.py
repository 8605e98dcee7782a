"""Q4_K weights in 4-row interleaved records (the int8 tile of kernels/cpu/interleaved.py runs them): the
repack at load, the sub-block scales for the f32 paths, and the f32 rows decoded back from the records.

File super-block (ggml-common.h, 144 bytes, 256 values): d f16, dmin f16, scales[12] (8 6-bit scales and
8 6-bit mins, get_scale_min_k4), qs[128]. Value 64 g + 32 h + l is nibble h of qs[32 g + l], in sub-block
s = 2 g + h, and equals (d sc_s) code - (dmin m_s). The record layout is in interleaved.py's docstring.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from bitserve.kernels.cpu.interleaved import (
    GROUP_ROWS,
    K_MINS_AT,
    K_SCALES_AT,
    KIND_Q4_K,
    QK,
    SCALES_AT,
    TYPE_SIZES,
    empty_records,
    record_slot,
)
from bitserve.kernels.reference.k_quants import scale_min_k4
from bitserve.kernels.reference.packed_bytes import f16_to_f32

SUPER_BLOCK = 256
SUB_BLOCKS = SUPER_BLOCK // QK  # 8 sub-blocks of 32 values


@njit(nogil=True, cache=True, inline="always")
def _scale_min(q: np.ndarray, at: int, j: int) -> tuple[int, int]:
    """ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 bytes at q[at:]."""
    if j < 4:
        return q[at + j] & 63, q[at + j + 4] & 63
    sc = (q[at + j + 4] & 15) | ((q[at + j - 4] >> 6) << 4)
    mn = (q[at + j + 4] >> 4) | ((q[at + j] >> 6) << 4)
    return sc, mn


@njit(nogil=True, cache=True)
def repack_q4_k(rows: np.ndarray) -> np.ndarray:
    """File rows uint8 [M, nb * 144] -> records uint8 [ceil(M / 4), nb, 592]."""
    num_rows = rows.shape[0]
    type_size = TYPE_SIZES[KIND_Q4_K]
    num_blocks = rows.shape[1] // type_size
    out = empty_records(num_rows, num_blocks, KIND_Q4_K)
    for row in range(num_rows):
        g, r = row // GROUP_ROWS, row % GROUP_ROWS
        for blk in range(num_blocks):
            src = blk * type_size
            for pair in range(4):
                for p in range(4):
                    for i in range(8):
                        out[g, blk, 128 * pair + 32 * p + 8 * r + i] = rows[
                            row, src + 16 + 32 * pair + 8 * p + i
                        ]
            for j in range(SUB_BLOCKS):
                sc, mn = _scale_min(rows[row], src + 4, j)
                out[g, blk, K_SCALES_AT + 4 * j + r] = sc
                out[g, blk, K_MINS_AT + 4 * j + r] = mn
            for i in range(2):
                out[g, blk, SCALES_AT[KIND_Q4_K] + 2 * r + i] = rows[row, src + i]  # d
                out[g, blk, SCALES_AT[KIND_Q4_K] + 8 + 2 * r + i] = rows[row, src + 2 + i]  # dmin
    return out


def sub_block_scales(rows: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """File rows uint8 [M, nb * 144] -> (d sc, -(dmin m)) f32 [M, K / 32]: the per-32-value scale and
    min the f32 rows decode with (the reference decoder's products)."""
    num_rows = rows.shape[0]
    blocks = rows.reshape(-1, TYPE_SIZES[KIND_Q4_K])
    d, dmin = f16_to_f32(blocks[:, :2]), f16_to_f32(blocks[:, 2:4])  # [N, 1]
    sc, mn = scale_min_k4(blocks[:, 4:16])  # int32 [N, 8]
    scale = (d * sc.float()).reshape(num_rows, num_cols // QK)
    minimum = (dmin * mn.float()).neg_().reshape(num_rows, num_cols // QK)
    return scale, minimum


@njit(parallel=True, nogil=True, cache=True)
def decode_q4_k_rows(w: np.ndarray, d: np.ndarray, m: np.ndarray, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) of records w -> buf f32 [rows, K]; d, m f32 [M, K / 32] from
    sub_block_scales: code d + m, i.e. (d sc) code - dmin m, ggml's values bit for bit."""
    for i in prange(buf.shape[0]):
        r = r0 + i
        g, slot = record_slot(r)
        for blk in range(w.shape[1]):
            for s in range(SUB_BLOCKS):
                pair, high = s // 2, s % 2
                sub = blk * SUB_BLOCKS + s
                for v in range(QK):
                    byte = np.int32(w[g, blk, 128 * pair + 32 * (v // 8) + slot + v % 8])
                    code = (byte >> np.int32(4 * high)) & np.int32(15)
                    buf[i, sub * QK + v] = np.float32(code) * d[r, sub] + m[r, sub]
