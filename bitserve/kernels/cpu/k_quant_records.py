"""Q2_K / Q4_K / Q5_K / Q6_K weights in 4-row interleaved records (the int8 tile of kernels/cpu/interleaved.py
runs them, its K-quant IR in k_quant_tile.py): the repack at load, the sub-block scales for the f32
paths, and the f32 rows decoded back from the records. A record is one 256-value super-block of 4 rows.

Q4_K file super-block (ggml-common.h, 144 bytes): d f16, dmin f16, scales[12] (8 6-bit scales and 8 6-bit
mins, get_scale_min_k4), qs[128]. Value 64 g + 32 h + l is nibble h of qs[32 g + l], in sub-block
s = 2 g + h, and equals (d sc_s) code - (dmin m_s). Record (592 bytes): interleaved.py's docstring.

Q5_K (176 bytes): d, dmin, scales[12] as Q4_K, qh[32], qs[128]; value 32 s + l gains bit s of qh[l] as
bit 4 of its code. Record (720 bytes): Q4_K's, then 4 high planes at Q5_K_HIGH_AT (plane g, byte 8 r + i:
bit 4 h + j is the high bit of value 32 (2 g + h) + 8 j + i).

Q6_K (210 bytes): ql[128], qh[64], scales[16] int8, d f16. Value v = 128 n + 32 s + l has the low nibble
(ql[64 n + 32 (s % 2) + l] >> 4 (s // 2)) & 15 and the top 2 bits (qh[32 n + l] >> 2 s) & 3, and equals
(d sc_{v / 16}) (code - 32). Record (840 bytes, the file's own): 16 nibble vectors as Q4_K's (vector
4 p + j, byte 8 r + i: the low nibbles of values 64 p + 8 j + i and 64 p + 32 + 8 j + i), 8 high planes
(plane b, byte 8 r + i: the top bits of value 32 b + 8 j + i at bits 2 j), the int8 scales (16-value
sub-block t's 4 rows at 768 + 4 t), d f16 [4].

Q2_K (84 bytes): scales[16] (scale | min << 4 per 16 values), qs[64], d f16, dmin f16. Value
v = 128 n + 32 j + 16 h + l has the code (qs[32 n + 16 h + l] >> 2 j) & 3 and equals (d sc_{v / 16}) code -
(dmin m_{v / 16}). Record (336 bytes, the file's own): interleaved.py's docstring.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from bitserve.kernels.cpu.interleaved import (
    GROUP_ROWS,
    KIND_Q2_K,
    KIND_Q4_K,
    KIND_Q5_K,
    KIND_Q6_K,
    QK,
    SCALES_AT,
    TYPE_SIZES,
    empty_records,
    record_slot,
)
from bitserve.kernels.cpu.k_quant_tile import (
    Q2_K_SCALES_AT,
    Q4_K_MINS_AT,
    Q4_K_SCALES_AT,
    Q5_K_HIGH_AT,
    Q6_K_HIGH_AT,
    Q6_K_SCALES_AT,
)
from bitserve.kernels.reference.k_quants import k4_scales, q2_k_scales, q3_k_codes, q6_k_scales

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
def repack_q4_k(rows: np.ndarray, kind: int) -> np.ndarray:
    """File rows uint8 [M, nb * 144] (Q4_K) or [M, nb * 176] (Q5_K) -> records uint8 [ceil(M / 4), nb,
    592 or 720]: Q5_K's qh[32] after d, dmin, scales, before qs; its planes at Q5_K_HIGH_AT."""
    num_rows = rows.shape[0]
    type_size = TYPE_SIZES[kind]
    num_blocks = rows.shape[1] // type_size
    out = empty_records(num_rows, num_blocks, kind)
    qs_at = 48 if kind == KIND_Q5_K else 16
    for row in range(num_rows):
        g, r = row // GROUP_ROWS, row % GROUP_ROWS
        for blk in range(num_blocks):
            src = blk * type_size
            for pair in range(4):
                for p in range(4):
                    for i in range(8):
                        out[g, blk, 128 * pair + 32 * p + 8 * r + i] = rows[
                            row, src + qs_at + 32 * pair + 8 * p + i
                        ]
            if kind == KIND_Q5_K:  # value 32 s + 8 j + i's bit 4: bit s of qh[8 j + i]
                for s in range(SUB_BLOCKS):
                    for j in range(4):
                        for i in range(8):
                            bit = (rows[row, src + 16 + 8 * j + i] >> s) & 1
                            out[g, blk, Q5_K_HIGH_AT + 32 * (s // 2) + 8 * r + i] |= bit << (4 * (s % 2) + j)
            for j in range(SUB_BLOCKS):
                sc, mn = _scale_min(rows[row], src + 4, j)
                out[g, blk, Q4_K_SCALES_AT + 4 * j + r] = sc
                out[g, blk, Q4_K_MINS_AT + 4 * j + r] = mn
            for i in range(2):
                out[g, blk, SCALES_AT[KIND_Q4_K] + 2 * r + i] = rows[row, src + i]  # d
                out[g, blk, SCALES_AT[KIND_Q4_K] + 8 + 2 * r + i] = rows[row, src + 2 + i]  # dmin
    return out


def sub_block_scales(rows: torch.Tensor, num_cols: int, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """File rows uint8 [M, nb * 144] (Q4_K) or [M, nb * 176] (Q5_K) -> (d sc, -(dmin m)) f32 [M, K / 32]:
    the per-32-value scale and min the f32 rows decode with (the reference decoder's products)."""
    scale, minimum = k4_scales(rows.reshape(-1, TYPE_SIZES[kind]))  # [N, 8]
    return scale.reshape(rows.shape[0], num_cols // QK), minimum.neg_().reshape(rows.shape[0], num_cols // QK)


@njit(parallel=True, nogil=True, cache=True)
def decode_q4_k_rows(
    w: np.ndarray, d: np.ndarray, m: np.ndarray, kind: int, r0: int, buf: np.ndarray
) -> None:
    """Rows r0 .. r0 + len(buf) of Q4_K or Q5_K records w -> buf f32 [rows, K]; d, m f32 [M, K / 32]
    from sub_block_scales: code d + m, i.e. (d sc) code - dmin m, ggml's values bit for bit."""
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
                    if kind == KIND_Q5_K:
                        plane = np.int32(w[g, blk, Q5_K_HIGH_AT + 32 * pair + slot + v % 8])
                        code |= ((plane >> np.int32(4 * high + v // 8)) & np.int32(1)) << np.int32(4)
                    buf[i, sub * QK + v] = np.float32(code) * d[r, sub] + m[r, sub]


@njit(nogil=True, cache=True, inline="always")
def _q6_k_fields(rows: np.ndarray, row: int, src: int, v: int) -> tuple[int, int]:
    """Q6_K value v of the super-block at byte src: (low nibble, top 2 bits)."""
    n, s, lane = v // 128, (v % 128) // 32, v % 32
    low = (rows[row, src + 64 * n + 32 * (s % 2) + lane] >> (4 * (s // 2))) & 15
    top = (rows[row, src + 128 + 32 * n + lane] >> (2 * s)) & 3
    return low, top


@njit(nogil=True, cache=True)
def repack_q6_k(rows: np.ndarray) -> np.ndarray:
    """File rows uint8 [M, nb * 210] -> records uint8 [ceil(M / 4), nb, 840]."""
    type_size = TYPE_SIZES[KIND_Q6_K]
    out = empty_records(rows.shape[0], rows.shape[1] // type_size, KIND_Q6_K)
    for row in range(rows.shape[0]):
        g, r = row // GROUP_ROWS, row % GROUP_ROWS
        for blk in range(out.shape[1]):
            src = blk * type_size
            for v in range(SUPER_BLOCK):
                low, top = _q6_k_fields(rows, row, src, v)
                b, j, i = v // QK, (v % QK) // 8, v % 8
                out[g, blk, 32 * (4 * (b // 2) + j) + 8 * r + i] |= low << (4 * (b % 2))
                out[g, blk, Q6_K_HIGH_AT + 32 * b + 8 * r + i] |= top << (2 * j)
            for t in range(16):
                out[g, blk, Q6_K_SCALES_AT + 4 * t + r] = rows[row, src + 192 + t]
            for i in range(2):
                out[g, blk, SCALES_AT[KIND_Q6_K] + 2 * r + i] = rows[row, src + 208 + i]
    return out


def q3_k_as_q6_k(rows: torch.Tensor) -> torch.Tensor:
    """Q3_K file rows uint8 [M, nb * 110] -> the same values as Q6_K file rows uint8 [M, nb * 210]: a
    Q3_K value (d sc) c (c in -4..3, sc in -32..31 per 16 values) is the Q6_K value (d sc) (c6 - 32) for
    c6 = c + 32, with Q3_K's d and scales, so the Q6_K records and tile run it (1.9x the Q3_K bytes, and
    exact: every product is an f16 times small integers). Q6_K's layout: value 128 n + 32 s + l has its
    low nibble in ql[64 n + 32 (s % 2) + l] at bits 4 (s // 2) and its top 2 bits in qh[32 n + l] at
    bits 2 s."""
    num_rows = rows.shape[0]
    blocks = rows.reshape(-1, 110)
    codes, scales = q3_k_codes(blocks)  # int32 [N, 256], [N, 16]
    c6 = (codes + 32).reshape(-1, 2, 4, 32)  # [N, n, s, l]
    low, top = c6 & 15, c6 >> 4
    ql = low[:, :, 0:2] | (low[:, :, 2:4] << 4)  # [N, n, s % 2, l]
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)  # [N, n, l]
    out = torch.empty(blocks.shape[0], TYPE_SIZES[KIND_Q6_K], dtype=torch.uint8)
    out[:, :128] = ql.reshape(-1, 128).to(torch.uint8)
    out[:, 128:192] = qh.reshape(-1, 64).to(torch.uint8)
    out[:, 192:208] = scales.to(torch.int8).view(torch.uint8)
    out[:, 208:210] = blocks[:, 108:110]  # d
    return out.reshape(num_rows, -1)


def q6_k_sub_block_scales(rows: torch.Tensor, num_cols: int) -> torch.Tensor:
    """File rows uint8 [M, nb * 210] -> d sc f32 [M, K / 16]: the per-16-value scale the f32 rows decode
    with (the reference decoder's product)."""
    return q6_k_scales(rows.reshape(-1, TYPE_SIZES[KIND_Q6_K])).reshape(rows.shape[0], num_cols // 16)


@njit(parallel=True, nogil=True, cache=True)
def decode_q6_k_rows(w: np.ndarray, d: np.ndarray, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) of Q6_K records w -> buf f32 [rows, K]; d f32 [M, K / 16] from
    q6_k_sub_block_scales: (code - 32) (d sc), ggml's values bit for bit."""
    for i in prange(buf.shape[0]):
        r = r0 + i
        g, slot = record_slot(r)
        for blk in range(w.shape[1]):
            for v in range(SUPER_BLOCK):
                b, j, k = v // QK, (v % QK) // 8, v % 8
                low = (np.int32(w[g, blk, 32 * (4 * (b // 2) + j) + slot + k]) >> np.int32(4 * (b % 2))) & 15
                top = (np.int32(w[g, blk, Q6_K_HIGH_AT + 32 * b + slot + k]) >> np.int32(2 * j)) & 3
                value = blk * SUPER_BLOCK + v
                buf[i, value] = np.float32((low | (top << 4)) - 32) * d[r, value // 16]


@njit(nogil=True, cache=True)
def repack_q2_k(rows: np.ndarray) -> np.ndarray:
    """File rows uint8 [M, nb * 84] -> records uint8 [ceil(M / 4), nb, 336]."""
    type_size = TYPE_SIZES[KIND_Q2_K]
    out = empty_records(rows.shape[0], rows.shape[1] // type_size, KIND_Q2_K)
    for row in range(rows.shape[0]):
        g, r = row // GROUP_ROWS, row % GROUP_ROWS
        for blk in range(out.shape[1]):
            src = blk * type_size
            for v in range(SUPER_BLOCK):
                n, j, half, lane = v // 128, (v % 128) // 32, (v % 32) // 16, v % 16
                code = (rows[row, src + 16 + 32 * n + 16 * half + lane] >> (2 * j)) & 3
                out[g, blk, 32 * (v // QK) + 8 * r + v % 8] |= code << (2 * ((v % QK) // 8))
            for t in range(16):
                out[g, blk, Q2_K_SCALES_AT + 4 * t + r] = rows[row, src + t]
            for i in range(2):
                out[g, blk, SCALES_AT[KIND_Q2_K] + 2 * r + i] = rows[row, src + 80 + i]  # d
                out[g, blk, SCALES_AT[KIND_Q2_K] + 8 + 2 * r + i] = rows[row, src + 82 + i]  # dmin
    return out


def q2_k_sub_block_scales(rows: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """File rows uint8 [M, nb * 84] -> (d sc, -(dmin m)) f32 [M, K / 16]: the per-16-value scale and min
    the f32 rows decode with (the reference decoder's products)."""
    scale, minimum = q2_k_scales(rows.reshape(-1, TYPE_SIZES[KIND_Q2_K]))  # [N, 16]
    return scale.reshape(rows.shape[0], num_cols // 16), minimum.neg_().reshape(rows.shape[0], num_cols // 16)


@njit(parallel=True, nogil=True, cache=True)
def decode_q2_k_rows(w: np.ndarray, d: np.ndarray, m: np.ndarray, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) of Q2_K records w -> buf f32 [rows, K]; d, m f32 [M, K / 16] from
    q2_k_sub_block_scales: code (d sc) - dmin m, ggml's values bit for bit."""
    for i in prange(buf.shape[0]):
        r = r0 + i
        g, slot = record_slot(r)
        for blk in range(w.shape[1]):
            for v in range(SUPER_BLOCK):
                byte = np.int32(w[g, blk, 32 * (v // QK) + slot + v % 8])
                code = (byte >> np.int32(2 * ((v % QK) // 8))) & np.int32(3)
                value = blk * SUPER_BLOCK + v
                buf[i, value] = np.float32(code) * d[r, value // 16] + m[r, value // 16]
