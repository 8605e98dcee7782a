"""Q2_0 / Q1_0 weights in 4-row interleaved records (the int8 tile of kernels/cpu/interleaved.py runs them):
the repack at load, and the f32 rows decoded back from the records for the sgemm path.

File blocks (llama.cpp's ggml-common.h): Q2_0 holds 64 values as d f16, then qs[16] with value j's 2-bit
code at bits 2 (j % 4) of qs[j / 4], value (code - 1) d; Q1_0 holds 128 values as d f16, then qs[16] with
value j's bit at bit j % 8 of qs[j / 8], value +d (1) or -d (0). A record is one file block of 4 rows:
two 32-byte vectors P0, P1, then the 4 rows' d f16 [4]: 72 bytes, the file's own 4 x 18. Value 8v + i of
row r sits in byte 8r + i of vector P[v // 4] at bits 2 (v % 4) (Q2_0), or P[v // 8] at bit v % 8 (Q1_0),
so one shift and one AND give the code vector v the tile multiplies with activations 8v .. 8v + 7.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from bitserve.kernels.cpu.interleaved import (
    GROUP_ROWS,
    KIND_Q1_0,
    KIND_Q2_0,
    SCALES_AT,
    empty_records,
    record_slot,
)

BLOCK_VALUES = {KIND_Q2_0: 64, KIND_Q1_0: 128}  # values per file block (= per record)
FILE_BLOCK_BYTES = 18  # both: d f16 + 16 bytes of codes
_CODES_AT = 2  # qs after d in a file block


@njit(nogil=True, cache=True, inline="always")
def _bits_per_value(kind: int) -> int:
    return 2 if kind == KIND_Q2_0 else 1


@njit(nogil=True, cache=True)
def repack_low_bit(rows: np.ndarray, kind: int) -> np.ndarray:
    """File rows uint8 [M, nb * 18] -> records uint8 [ceil(M / 4), nb, 72] (module docstring)."""
    num_rows = rows.shape[0]
    num_blocks = rows.shape[1] // FILE_BLOCK_BYTES
    bits = _bits_per_value(kind)
    per_byte = 8 // bits  # values per file byte: 4 (Q2_0) or 8 (Q1_0)
    mask = (1 << bits) - 1
    values = (FILE_BLOCK_BYTES - _CODES_AT) * per_byte  # per block: 64 or 128
    out = empty_records(num_rows, num_blocks, kind)
    for row in range(num_rows):
        g, r = row // GROUP_ROWS, row % GROUP_ROWS
        for blk in range(num_blocks):
            src = blk * FILE_BLOCK_BYTES
            for j in range(values):
                code = (rows[row, src + _CODES_AT + j // per_byte] >> (bits * (j % per_byte))) & mask
                v, i = j // 8, j % 8
                vector, shift = v // per_byte, bits * (v % per_byte)
                out[g, blk, 32 * vector + 8 * r + i] |= code << shift
            out[g, blk, SCALES_AT[kind] + 2 * r] = rows[row, src]  # d f16, as in the file
            out[g, blk, SCALES_AT[kind] + 2 * r + 1] = rows[row, src + 1]
    return out


@njit(parallel=True, nogil=True, cache=True)
def decode_low_bit_rows(w: np.ndarray, d: np.ndarray, kind: int, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) of records w uint8 [G, nb, 72] -> buf f32 [rows, K], d f32 [M, nb]:
    (code - 1) d (Q2_0) or (2 code - 1) d (Q1_0), ggml's dequantize_row values bit for bit."""
    bits = _bits_per_value(kind)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    values = (FILE_BLOCK_BYTES - _CODES_AT) * per_byte  # per block: 64 or 128
    for i in prange(buf.shape[0]):
        r = r0 + i
        g, slot = record_slot(r)
        for blk in range(d.shape[1]):
            db = d[r, blk]
            for j in range(values):
                v, k = j // 8, j % 8
                byte = np.int32(w[g, blk, 32 * (v // per_byte) + slot + k])
                code = (byte >> np.int32(bits * (v % per_byte))) & np.int32(mask)
                level = code - 1 if kind == KIND_Q2_0 else 2 * code - 1
                buf[i, blk * values + j] = np.float32(level) * db
