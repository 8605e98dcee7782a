"""numba kernels for Q4_0 / Q4_1 / Q8_0 linears on packed weights (no f32 weight copy is kept).

Runtime form (made once at load from the GGUF blocks), rows interleaved in groups of 64 so the inner
loop runs over 64 output rows (vectorizable with no float reassociation): codes uint8 [G, K / 2, 64]
(Q4_*: the 16 `qs` bytes of each block, low nibble = value j, high nibble = value j + 16) or int8
[G, K, 64] (Q8_0), block scales d f32 [G, K / 32, 64] and, for Q4_1, mins m (f16 -> f32 is exact).
Q4_0 is stored as Q4_1 with m = -8 d, so one kernel serves both; its dequantized values then round
differently from ggml's (code - 8) * d, hence the same tolerance as the dot products.
Numerics: f32 accumulation in a fixed lane order, NOT bit-exact with F.linear(x, dequantize(w)):
agreement is within fp32 summation-order error (about 1e-6 of max |y| at K = 1536).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

QK = 32  # values per block (ggml QK4_0 / QK4_1 / QK8_0)
HALF = QK // 2
GROUP_ROWS = 64  # output rows interleaved per column in the runtime layout (one prange task each)


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """uint8 [M, nb, type_size] -> f32 [M, nb] from the little-endian f16 at byte `start` (exact)."""
    return blocks[:, :, start : start + 2].contiguous().view(torch.float16).squeeze(-1).float().contiguous()


def block_field_f32(rows: torch.Tensor, type_size: int, start: int) -> torch.Tensor:
    """The f16 field at byte `start` of every block of rows uint8 [M, nb * type_size] -> f32 [M, nb]
    (blocks of any number of values: Q4 / Q8 / Q5 of 32, Q2_0 of 64, Q1_0 of 128)."""
    return _f16_field(rows.reshape(rows.shape[0], -1, type_size), start)


def _group_rows(a: torch.Tensor) -> torch.Tensor:
    """[M, C] -> [ceil(M / GROUP_ROWS), C, GROUP_ROWS] (zero rows pad M): the kernels' inner loop runs
    over GROUP_ROWS output rows of one column, which LLVM's loop vectorizer handles without reassociation."""
    num_rows, num_cols = a.shape
    num_groups = -(-num_rows // GROUP_ROWS)
    padded = a.new_zeros(num_groups * GROUP_ROWS, num_cols)
    padded[:num_rows] = a
    return padded.view(num_groups, GROUP_ROWS, num_cols).transpose(1, 2).contiguous()


def repack_q4(
    rows: torch.Tensor, num_cols: int, has_min: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (has_min) or Q4_0 rows uint8 [M, row_bytes] -> grouped (codes uint8 [G, K/2, 64], d f32
    [G, nb, 64], m f32 [G, nb, 64]) with G = ceil(M / 64). Always copies (the file pages may be released)."""
    num_rows, num_blocks = rows.shape[0], num_cols // QK
    type_size = 20 if has_min else 18
    blocks = rows.reshape(num_rows, num_blocks, type_size)
    d = _f16_field(blocks, 0)
    m = _f16_field(blocks, 2) if has_min else d * -8.0  # exact: a power-of-two multiple of an f16 value
    qs = blocks[:, :, type_size - HALF :].reshape(num_rows, num_cols // 2)
    return _group_rows(qs), _group_rows(d), _group_rows(m)


def repack_q8_0(rows: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows uint8 [M, row_bytes] -> grouped (codes int8 [G, K, 64], d f32 [G, nb, 64])."""
    num_rows, num_blocks = rows.shape[0], num_cols // QK
    blocks = rows.reshape(num_rows, num_blocks, QK + 2)
    q = blocks[:, :, 2:].reshape(num_rows, num_cols).view(torch.int8)
    return _group_rows(q), _group_rows(_f16_field(blocks, 0))


@njit(nogil=True, cache=True)
def block_sums(x: np.ndarray) -> np.ndarray:
    """x f32 [T, K] -> f32 [T, K / 32]: the sum of each 32-value block (for the Q4_1 min term)."""
    num_tokens, k = x.shape
    out = np.zeros((num_tokens, k // QK), dtype=np.float32)
    for t in range(num_tokens):
        for b in range(k // QK):
            s = np.float32(0.0)
            for j in range(QK):
                s += x[t, b * QK + j]
            out[t, b] = s
    return out


@njit(parallel=True, nogil=True, cache=True)
def q4_linear_kernel(
    cg: np.ndarray, dg: np.ndarray, mg: np.ndarray, x: np.ndarray, xsum: np.ndarray, out: np.ndarray
) -> None:
    """y[t, r] = sum_b (d[r, b] * sum_j code * x + m[r, b] * xsum[t, b]), blocks in order, each block's
    dot in column order j, j + 16 pairs. cg uint8 [G, K/2, 64], dg/mg f32 [G, nb, 64], x f32 [T, K],
    xsum f32 [T, nb] -> out f32 [T, M] (M <= 64 G). One task per 64-row group; codes converted once
    per group for all tokens."""
    num_groups, num_bytes, group = cg.shape
    num_tokens, k = x.shape
    num_rows = out.shape[1]
    for g in prange(num_groups):
        lo = np.empty(group, np.float32)
        hi = np.empty(group, np.float32)
        acc_b = np.empty((num_tokens, group), np.float32)
        acc = np.zeros((num_tokens, group), np.float32)
        for b in range(k // QK):
            acc_b[:] = 0.0
            for j in range(HALF):
                c = cg[g, b * HALF + j]
                for r in range(group):
                    byte = np.int32(c[r])
                    lo[r] = np.float32(byte & np.int32(15))
                    hi[r] = np.float32(byte >> np.int32(4))
                for t in range(num_tokens):
                    xl, xh = x[t, b * QK + j], x[t, b * QK + HALF + j]
                    ab = acc_b[t]
                    for r in range(group):
                        ab[r] += lo[r] * xl + hi[r] * xh
            db, mb = dg[g, b], mg[g, b]
            for t in range(num_tokens):
                xs, ab, a = xsum[t, b], acc_b[t], acc[t]
                for r in range(group):
                    a[r] += db[r] * ab[r] + mb[r] * xs
        _store_group(acc, g, num_rows, out)


@njit(parallel=True, nogil=True, cache=True)
def q8_0_linear_kernel(qg: np.ndarray, dg: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """y[t, r] = sum_b d[r, b] * sum_j q * x. qg int8 [G, K, 64], dg f32 [G, nb, 64], x f32 [T, K]
    -> out f32 [T, M]."""
    num_groups, k, group = qg.shape
    num_tokens = x.shape[0]
    num_rows = out.shape[1]
    for g in prange(num_groups):
        w = np.empty(group, np.float32)
        acc_b = np.empty((num_tokens, group), np.float32)
        acc = np.zeros((num_tokens, group), np.float32)
        for b in range(k // QK):
            acc_b[:] = 0.0
            for j in range(QK):
                c = qg[g, b * QK + j]
                for r in range(group):
                    w[r] = np.float32(np.int32(c[r]))
                for t in range(num_tokens):
                    xv, ab = x[t, b * QK + j], acc_b[t]
                    for r in range(group):
                        ab[r] += w[r] * xv
            db = dg[g, b]
            for t in range(num_tokens):
                ab, a = acc_b[t], acc[t]
                for r in range(group):
                    a[r] += db[r] * ab[r]
        _store_group(acc, g, num_rows, out)


@njit(nogil=True, cache=True, inline="always")
def _store_group(acc: np.ndarray, g: int, num_rows: int, out: np.ndarray) -> None:
    """acc f32 [T, 64] of group g -> out[:, 64 g : 64 g + 64], dropping padding rows."""
    group = acc.shape[1]
    for t in range(acc.shape[0]):
        for r in range(min(group, num_rows - g * group)):
            out[t, g * group + r] = acc[t, r]


@njit(parallel=True, nogil=True, cache=True)
def decode_q4_rows(cg: np.ndarray, dg: np.ndarray, mg: np.ndarray, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) -> f32 code * d + m (two roundings, as ggml's Q4_1). buf f32 [rows, K]."""
    group = cg.shape[2]
    num_blocks = dg.shape[1]
    for i in prange(buf.shape[0]):
        g, rr = divmod(r0 + i, group)
        for b in range(num_blocks):
            db, mb = dg[g, b, rr], mg[g, b, rr]
            for j in range(HALF):
                byte = np.int32(cg[g, b * HALF + j, rr])
                buf[i, b * QK + j] = np.float32(byte & np.int32(15)) * db + mb
                buf[i, b * QK + HALF + j] = np.float32(byte >> np.int32(4)) * db + mb


@njit(parallel=True, nogil=True, cache=True)
def decode_q8_0_rows(qg: np.ndarray, dg: np.ndarray, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) -> f32 q * d (exact as ggml's Q8_0). buf f32 [rows, K]."""
    group = qg.shape[2]
    num_blocks = dg.shape[1]
    for i in prange(buf.shape[0]):
        g, rr = divmod(r0 + i, group)
        for b in range(num_blocks):
            db = dg[g, b, rr]
            for j in range(QK):
                buf[i, b * QK + j] = np.float32(np.int32(qg[g, b * QK + j, rr])) * db
