"""int8-activation ternary GEMV / GEMM on the packed 2-bit layout, with x86 integer-dot instructions.

Weights stay in Layout.TERNARY_2BIT (kernels/cpu/ternary.py), which is I2_S's x86 layout: per row,
32-byte groups of 128 columns, byte m's 2-bit field at bits 6 - 2s, 7 - 2s holding code t + 1 of column
128g + 32s + m. So one 32-byte load of codes gives, after a shift by 6 - 2s and an AND with 3, the 32
codes of "plane" s, lined up with the 32 contiguous int8 activations q[128g + 32s : 128g + 32s + 32] in
their natural order. Rows are found through a table of byte offsets into one uint8 buffer, so a stacked
group's rows may lie in several tensors of the mapped file (I2_S read in place: kernels/cpu/mapped.py).
Per group and (row, token) pair that is four u8 x s8 dot steps:
- AVX2: `vpmaddubsw` (pairs of code * q summed into int16 lanes), int16 sums of FLUSH_GROUPS groups,
  then `vpmaddwd` by 1 widens them into int32 lanes;
- VNNI: `vpdpbusd` (quads summed straight into int32 lanes), no int16 stage.
Then D = sum(code * q) - sum(q) (code = t + 1), exact, and the f32 epilogue of docs/formats.md §3.3.

numba's auto-vectorizer never emits these instructions, so the tile (kernels/cpu/int8_tile.py's `_tile`) is
an `@intrinsic` writing the loop in LLVM IR with the x86 intrinsics: `rows` weight rows x `toks` tokens,
each row's codes decoded once per group for all tokens. The kernels only run on a CPU with the variant's
features (kernels/cpu/isa.py): they are compiled on first call, so an unsupported variant never is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import literally, njit, prange

from bitserve.kernels.cpu.int8_tile import _AVX2, _VNNI, _tile
from bitserve.kernels.cpu.isa import Isa, target_features
from bitserve.kernels.cpu.ternary import GROUP_COLS, quantize_rows_into

ROWS_PER_TASK = 16  # rows per prange task (a multiple of every row tile)
TOKEN_BLOCK = 32  # tokens per pass over a task's rows: 32 x Kp int8 activations stay in L2

# ---------------------------------------------------------------- activations


@njit(nogil=True, cache=True)
def quantize_int8(x: np.ndarray, kp: int, padded_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32 [T, K] -> (q int8 [padded_tokens, Kp], zero rows / columns as padding, s_act f32 [T],
    q_sum int32 [T]): ternary.quantize_rows_into's arithmetic, as int8 in natural column order."""
    q = np.zeros((padded_tokens, kp), dtype=np.int8)
    s_act, q_sum = quantize_rows_into(x, q)
    return q, s_act, q_sum


def padded_token_count(num_tokens: int, toks: int) -> int:
    """Rows of the activation buffer: num_tokens rounded up to the kernel's token tile."""
    return -(-num_tokens // toks) * toks


def padded_tokens(num_tokens: int) -> int:
    """Rows of activations the ternary kernel for num_tokens tokens reads: one row for a GEMV, else
    whole GEMM token tiles (the quantizer pads with zero rows)."""
    return 1 if num_tokens == 1 else padded_token_count(num_tokens, GEMM_TOKENS)


def row_table(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [M, Kp / 4] rows, C order -> (the same bytes as uint8 [M * Kp / 4], row byte offsets int64
    [M]): the kernels' form of a weight whose rows lie one after another (no copy)."""
    num_rows, row_bytes = rows.shape
    return rows.reshape(-1), np.arange(num_rows, dtype=np.int64) * row_bytes


# ---------------------------------------------------------------- kernels


@njit(parallel=True, nogil=True, cache=True)
def _bitnet_body(
    isa: int,
    rows: int,
    toks: int,
    weight: tuple,
    q: np.ndarray,
    q_sum: np.ndarray,
    s_act: np.ndarray,
    row_scale: np.ndarray,
    out: np.ndarray,
) -> None:
    """One scale per row. weight = (w uint8 [n], row_off int64 [M]): row r's Kp / 4 bytes start at
    w[row_off[r]] (row_table). q int8 [Tp, Kp] (Tp a multiple of toks), q_sum int32 [T],
    s_act f32 [T], row_scale f32 [M] -> out f32 [T, M]. isa / rows / toks: literals (ISA_CODES, the
    tile shape). row_scale is a weight's per-tensor scale repeated, or, for a stacked group (q/k/v,
    gate/up), each row's own weight's scale: a tile may straddle two weights.

    D = sum(code * q) - sum(q), exact; y = f32(f32(f32(D) / s_act) * row_scale[r]), as in
    ternary.bitnet_linear_kernel. Per task, TOKEN_BLOCK tokens at a time run over the task's rows, whose
    codes (16 x Kp / 4 bytes) stay in cache: each weight byte comes from memory once per step.
    """
    literally(isa)
    literally(rows)
    literally(toks)
    m = out.shape[1]
    operands = (q, q_sum, s_act, row_scale, out)
    for task in prange((m + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r_start = task * ROWS_PER_TASK
        r_end = min(m, r_start + ROWS_PER_TASK)
        for t_block in range(0, q.shape[0], TOKEN_BLOCK):
            for t0 in range(t_block, min(q.shape[0], t_block + TOKEN_BLOCK), toks):
                _row_tiles(isa, rows, toks, (weight, r_start, r_end, t0), operands)


@njit(nogil=True, cache=True, inline="always")
def _row_tiles(isa: int, rows: int, toks: int, where: tuple, operands: tuple) -> None:
    """where = (weight, r_start, r_end, t0): tokens t0 .. t0 + toks - 1 over rows r_start .. r_end - 1,
    in tiles of `rows` rows, then single rows. operands = (q, q_sum, s_act, row_scale, out), as the
    bodies take them."""
    weight, r_start, r_end, t0 = where
    q, q_sum, s_act, row_scale, out = operands
    w, row_off = weight
    num_groups = q.shape[1] // GROUP_COLS
    full_end = r_start + (r_end - r_start) // rows * rows
    for r in range(r_start, full_end, rows):
        d = _tile(isa, rows, toks, w, row_off, r, q, t0, 0, num_groups)
        _store_tile(d, rows, toks, r, t0, q_sum, s_act, row_scale, out)
    for r in range(full_end, r_end):
        d1 = _tile(isa, 1, toks, w, row_off, r, q, t0, 0, num_groups)
        _store_tile(d1, 1, toks, r, t0, q_sum, s_act, row_scale, out)


@njit(parallel=True, nogil=True, cache=True)
def _bitnet_wide_body(
    weight: tuple, q: np.ndarray, q_sum: np.ndarray, s_act: np.ndarray, row_scale: np.ndarray, out: np.ndarray
) -> None:
    """_bitnet_body's result for T = out.shape[0] >= 2 on a VNNI target with 32 vector registers, in
    tiles of 4 rows x up to 5 tokens: the real tokens go in chunks of 4, the last chunk of a block
    holding 1-5 of them (T = 5, a 4-draft verify, is one tile; nothing pads to a tile). Every row's
    codes are unpacked once per chunk, against once per 2 tokens in the 4 x 2 tile, and vpdpbusd
    takes the activations straight from memory: a 4 x 5 tile holds 20 accumulators and 16 planes.
    Measured on Zen 4 (2 threads, the 2B-4T layer's four shapes, benchmarks/RESULTS.md 2026-12-07):
    1.80 -> 1.22 ms at T = 5, 37.7 -> 32.0 ms at T = 128. q rows past T (padding) are not read."""
    m = out.shape[1]
    num_tokens = out.shape[0]
    operands = (q, q_sum, s_act, row_scale, out)
    for task in prange((m + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r_start = task * ROWS_PER_TASK
        r_end = min(m, r_start + ROWS_PER_TASK)
        for t_block in range(0, num_tokens, TOKEN_BLOCK):
            t_end = min(num_tokens, t_block + TOKEN_BLOCK)
            t0 = t_block
            while t0 < t_end:
                left = t_end - t0
                width = 5 if left == 5 else min(left, 4)
                where = (weight, r_start, r_end, t0)
                # the tile's token count must be a literal: one call per width
                if width == 5:
                    _row_tiles(_VNNI, 4, 5, where, operands)
                elif width == 4:
                    _row_tiles(_VNNI, 4, 4, where, operands)
                elif width == 3:
                    _row_tiles(_VNNI, 4, 3, where, operands)
                elif width == 2:
                    _row_tiles(_VNNI, 4, 2, where, operands)
                else:
                    _row_tiles(_VNNI, 4, 1, where, operands)
                t0 += width


@njit(nogil=True, cache=True, inline="always")
def _store_tile(
    d: tuple,
    rows: int,
    toks: int,
    r0: int,
    t0: int,
    q_sum: np.ndarray,
    s_act: np.ndarray,
    row_scale: np.ndarray,
    out: np.ndarray,
) -> None:
    """Tile epilogue, real tokens only: out[t, r] = f32(f32(f32(D) / s_act) * row_scale[r]),
    D = d - q_sum."""
    for t in range(t0, min(t0 + toks, out.shape[0])):
        for i in range(rows):
            di = d[i * toks + t - t0] - q_sum[t]
            out[t, r0 + i] = (np.float32(di) / s_act[t]) * row_scale[r0 + i]


@njit(parallel=True, nogil=True, cache=True)
def _bitnet_block_body(
    isa: int,
    rows: int,
    weight: tuple,
    q: np.ndarray,
    block_q_sum: np.ndarray,
    s_act: np.ndarray,
    scale: np.ndarray,
    out: np.ndarray,
) -> None:
    """Per-block scales f32 [M, nb], block_q_sum int32 [T, nb] -> out f32 [T, M]; one token per tile.
    weight = (w, row_off): as in _bitnet_body.

    y = sum over blocks b in increasing order of f32(f32(f32(D_b) / s_act) * d_b), from +0.0, rounding
    after each add (ternary.bitnet_block_linear_kernel's order). A block is Kp / nb columns, a
    whole number of groups.
    """
    literally(isa)
    literally(rows)
    w, row_off = weight
    m = out.shape[1]
    num_blocks = scale.shape[1]
    block_groups = q.shape[1] // GROUP_COLS // num_blocks
    for task in prange((m + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r_start = task * ROWS_PER_TASK
        r_end = min(m, r_start + ROWS_PER_TASK)
        full_end = r_start + (r_end - r_start) // rows * rows
        y = np.empty(rows, dtype=np.float32)
        for t in range(out.shape[0]):
            for r in range(r_start, full_end, rows):
                y[:] = 0.0
                for b in range(num_blocks):
                    d = _tile(isa, rows, 1, w, row_off, r, q, t, b * block_groups, block_groups)
                    for i in range(rows):
                        di = d[i] - block_q_sum[t, b]
                        y[i] = y[i] + (np.float32(di) / s_act[t]) * scale[r + i, b]
                out[t, r : r + rows] = y
            for r in range(full_end, r_end):
                y1 = np.float32(0.0)
                for b in range(num_blocks):
                    d1 = _tile(isa, 1, 1, w, row_off, r, q, t, b * block_groups, block_groups)
                    y1 = y1 + (np.float32(d1[0] - block_q_sum[t, b]) / s_act[t]) * scale[r, b]
                out[t, r] = y1


# ---------------------------------------------------------------- entry points, one per (ISA, tile)
# Thin wrappers pass the literals as constants: a Python caller then hits numba's compiled-signature fast
# path (the literal-typed bodies would be re-dispatched on every call from Python).
# Tiles measured on Zen 3 (AVX2, benchmarks/RESULTS.md): 8 rows x 1 token for T = 1, 4 x 2 above; the
# VNNI GEMM's on Zen 4 (_bitnet_wide_body).

GEMM_TOKENS = 2  # token tile of the GEMM kernels: their activations are padded to a multiple of it
# AVX512-VNNI targets have 32 vector registers: the VNNI GEMM runs _bitnet_wide_body's 4 x 4-5 tiles there.
# AVX-VNNI alone (16 registers) would spill them, and keeps the 4 x 2 tile.
WIDE_VNNI_TILES = "avx512vl" in target_features()


@njit(nogil=True, cache=True)
def avx2_gemv(
    weight: tuple, q: np.ndarray, q_sum: np.ndarray, s_act: np.ndarray, row_scale: np.ndarray, out: np.ndarray
) -> None:
    _bitnet_body(_AVX2, 8, 1, weight, q, q_sum, s_act, row_scale, out)


@njit(nogil=True, cache=True)
def avx2_gemm(
    weight: tuple, q: np.ndarray, q_sum: np.ndarray, s_act: np.ndarray, row_scale: np.ndarray, out: np.ndarray
) -> None:
    _bitnet_body(_AVX2, 4, GEMM_TOKENS, weight, q, q_sum, s_act, row_scale, out)


@njit(nogil=True, cache=True)
def avx2_block(
    weight: tuple, q: np.ndarray, q_sums: np.ndarray, s_act: np.ndarray, scale: np.ndarray, out: np.ndarray
) -> None:
    _bitnet_block_body(_AVX2, 4, weight, q, q_sums, s_act, scale, out)


@njit(nogil=True, cache=True)
def vnni_gemv(
    weight: tuple, q: np.ndarray, q_sum: np.ndarray, s_act: np.ndarray, row_scale: np.ndarray, out: np.ndarray
) -> None:
    _bitnet_body(_VNNI, 4, 1, weight, q, q_sum, s_act, row_scale, out)


@njit(nogil=True, cache=True)
def vnni_gemm(
    weight: tuple, q: np.ndarray, q_sum: np.ndarray, s_act: np.ndarray, row_scale: np.ndarray, out: np.ndarray
) -> None:
    if WIDE_VNNI_TILES:  # a compile-time constant: numba's cache is keyed on the target's features too
        _bitnet_wide_body(weight, q, q_sum, s_act, row_scale, out)
    else:
        _bitnet_body(_VNNI, 4, GEMM_TOKENS, weight, q, q_sum, s_act, row_scale, out)


@njit(nogil=True, cache=True)
def vnni_block(
    weight: tuple, q: np.ndarray, q_sums: np.ndarray, s_act: np.ndarray, scale: np.ndarray, out: np.ndarray
) -> None:
    _bitnet_block_body(_VNNI, 4, weight, q, q_sums, s_act, scale, out)


@dataclass(frozen=True)
class Int8Kernels:
    """One ISA's entry points. gemv: T = 1; gemm: T >= 2 on activations padded to GEMM_TOKENS rows (both
    with one scale per row, f32 [M]); block: per-block scales, any T. All take the weight as one tuple
    (w uint8 [n], row_off int64 [M]: see row_table) and write f32 [T, M] into `out`."""

    isa: Isa
    gemv: Callable[..., None]
    gemm: Callable[..., None]
    block: Callable[..., None]


KERNELS = {
    Isa.AVX2: Int8Kernels(Isa.AVX2, avx2_gemv, avx2_gemm, avx2_block),
    Isa.VNNI: Int8Kernels(Isa.VNNI, vnni_gemv, vnni_gemm, vnni_block),
}
