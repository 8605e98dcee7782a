"""Q5_0 / Q5_1 weights in 4-row interleaved records (the int8 tile of kernels/cpu/interleaved.py runs them):
the repack at load, and the f32 rows decoded back from the records for the sgemm path.

File blocks of 32 values (ggml-common.h): Q5_0 is d f16, qh u32, qs[16]; Q5_1 is d f16, m f16, qh u32,
qs[16]. Value j's 5-bit code is the low (j < 16) or high (j >= 16) nibble of qs[j % 16], plus bit j of qh
as its bit 4; the value is (code - 16) d (Q5_0) or code d + m (Q5_1). A record: the two nibble vectors of
a Q4 record (bytes 8r + i of vector p: qs[8p + i] of row r), then H (32 bytes, byte 8r + i: bit 8j + i of
row r's qh as bit j, j < 4), then d f16 [4] and, for Q5_1, m f16 [4].
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bitserve.kernels.cpu.interleaved import (
    GROUP_ROWS,
    KIND_Q5_0,
    KIND_Q5_1,
    QK,
    SCALES_AT,
    TYPE_SIZES,
    empty_records,
    record_slot,
)

FIVE_BIT_KINDS = (KIND_Q5_0, KIND_Q5_1)
_HIGH_AT = 64  # H after the two nibble vectors


@njit(nogil=True, cache=True, inline="always")
def _qh_at(kind: int) -> int:
    return 4 if kind == KIND_Q5_1 else 2  # qh after d (and m)


@njit(nogil=True, cache=True)
def repack_five_bit(rows: np.ndarray, kind: int) -> np.ndarray:
    """File rows uint8 [M, nb * type_size] -> records uint8 [ceil(M / 4), nb, RECORD_BYTES[kind]]."""
    num_rows = rows.shape[0]
    type_size = TYPE_SIZES[kind]
    num_blocks = rows.shape[1] // type_size
    qh_at = _qh_at(kind)
    out = empty_records(num_rows, num_blocks, kind)
    for row in range(num_rows):
        g, r = row // GROUP_ROWS, row % GROUP_ROWS
        for blk in range(num_blocks):
            src = blk * type_size
            qh = np.uint32(0)
            for i in range(4):
                qh |= np.uint32(rows[row, src + qh_at + i]) << np.uint32(8 * i)
            for i in range(8):
                for p in range(2):
                    out[g, blk, 32 * p + 8 * r + i] = rows[row, src + qh_at + 4 + 8 * p + i]
                high = 0
                for j in range(4):
                    high |= ((qh >> np.uint32(8 * j + i)) & np.uint32(1)) << np.uint32(j)
                out[g, blk, _HIGH_AT + 8 * r + i] = high
            for i in range(2 if kind == KIND_Q5_0 else 4):  # d, then Q5_1's m, as f16 bytes
                field = SCALES_AT[kind] + (i // 2) * 2 * GROUP_ROWS + 2 * r + i % 2
                out[g, blk, field] = rows[row, src + i]
    return out


@njit(parallel=True, nogil=True, cache=True)
def decode_five_bit_rows(
    w: np.ndarray, d: np.ndarray, m: np.ndarray, kind: int, r0: int, buf: np.ndarray
) -> None:
    """Rows r0 .. r0 + len(buf) of records w -> buf f32 [rows, K]; d, m f32 [M, nb] (m unused for Q5_0):
    (code - 16) d or code d + m, ggml's dequantize_row values bit for bit."""
    for i in prange(buf.shape[0]):
        r = r0 + i
        g, slot = record_slot(r)
        for blk in range(d.shape[1]):
            for v in range(QK):
                j, k = v // 8, v % 8
                byte = np.int32(w[g, blk, 32 * (j % 2) + slot + k])
                nibble = (byte & np.int32(15)) if j < 2 else (byte >> np.int32(4))
                high = (np.int32(w[g, blk, _HIGH_AT + slot + k]) >> np.int32(j)) & np.int32(1)
                code = nibble | (high << np.int32(4))
                if kind == KIND_Q5_0:
                    buf[i, blk * QK + v] = np.float32(code - 16) * d[r, blk]
                else:
                    buf[i, blk * QK + v] = np.float32(code) * d[r, blk] + m[r, blk]
