"""numba kernels for 2-bit packed ternary linears on CPU (docs/formats.md §3 semantics, bit-exact).

Weights stay packed in Layout.TERNARY_2BIT, which is I2_S's x86 layout (variant A) row by row: code t+1,
K padded to a multiple of 128 with code 1 (t = 0); inside a 128-column group g, byte 32g + m holds the
codes of columns 128g + 32s + m at bits 6 - 2s, 7 - 2s (s = 0..3: the high field first). So I2_S rows are
read in place from the file mapping, and each field s of a 32-byte group lines up with the 32 contiguous
activations of its "plane": activations keep their natural column order. All kernels release the GIL;
parallel ones split output rows.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic

GROUP_COLS = 128  # columns per 32-byte group of packed weights
GROUP_BYTES = GROUP_COLS // 4
PLANES = 4  # 2-bit fields per byte
ROWS_PER_TASK = 16  # rows per prange task: one decode buffer allocation per task
NUM_TQ_LANES = 8
QK_K = 256


def padded_in_features(k: int) -> int:
    """K rounded up to a whole number of 128-column groups."""
    return -(-k // GROUP_COLS) * GROUP_COLS


def pack_ternary(values: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] in {-1, 0, 1} -> uint8 [M, Kp / 4] in the layout above (I2_S variant A per row).

    Padding columns get code 1 (t = 0), so they add nothing to any dot product.
    """
    m, k = values.shape
    kp = padded_in_features(k)
    codes = torch.ones(m, kp, dtype=torch.uint8)
    codes[:, :k] = (values.to(torch.int16) + 1).to(torch.uint8)
    planes = codes.view(m, kp // GROUP_COLS, PLANES, GROUP_BYTES)  # [M, groups, s, m]: column 128g + 32s + m
    packed = (planes[:, :, 0] << 6) | (planes[:, :, 1] << 4) | (planes[:, :, 2] << 2) | planes[:, :, 3]
    return packed.reshape(m, kp // 4).contiguous()


@njit(nogil=True, cache=True)
def smoke_test(a: np.ndarray) -> int:
    """Sum of an int16 array: proves numba compiles and runs here."""
    total = 0
    for v in a:
        total += v
    return total


# ---------------------------------------------------------------- activations


@njit(nogil=True, cache=True)
def activation_scale(row: np.ndarray) -> np.float32:
    """s_act of one row f32 [K] (docs/formats.md §3.1): amax in f64 with the 1e-5 floor, then
    f32(127 / amax) divided in f64. The one copy, called by quantize_rows_into."""
    amax = 1e-5
    for value in row:
        a = abs(np.float64(value))
        if a > amax:
            amax = a
    return np.float32(127.0 / amax)


@njit(nogil=True, cache=True, inline="always")
def quantize_value(x: np.float32, s: np.float32) -> np.int8:
    """One activation's int8 value: clamp(rne(f32 product x * s)) (docs/formats.md §3.1)."""
    v = np.round(x * s)  # f32 product, round half to even
    return np.int8(min(max(v, np.float32(-128.0)), np.float32(127.0)))


@njit(nogil=True, cache=True)
def quantize_rows_into(x: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activation quantization (docs/formats.md §3.1) of each row, the one loop of both quantizers.

    x f32 [T, K] -> q[:T, :K] (int16 or int8: numba compiles one copy per dtype; the caller's zeros
    elsewhere are the padding), returning (s_act f32 [T], q_sum int32 [T]). amax in f64 with the
    1e-5 floor; s_act = f32(127 / amax) divided in f64; q = clamp(rne(f32 product)). Rows holding NaN
    give unspecified values (as in the reference).
    """
    num_tokens, k = x.shape
    s_act = np.empty(num_tokens, dtype=np.float32)
    q_sum = np.zeros(num_tokens, dtype=np.int32)
    for t in range(num_tokens):
        s = activation_scale(x[t])
        s_act[t] = s
        total = 0
        for j in range(k):
            qi = quantize_value(x[t, j], s)
            q[t, j] = qi
            total += qi
        q_sum[t] = total
    return s_act, q_sum


@njit(nogil=True, cache=True)
def quantize_int16(x: np.ndarray, kp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32 [T, K] -> (q int16 [T, Kp] zero-padded, s_act f32 [T], q_sum int32 [T]) for the portable
    kernels (quantize_rows_into)."""
    q = np.zeros((x.shape[0], kp), dtype=np.int16)
    s_act, q_sum = quantize_rows_into(x, q)
    return q, s_act, q_sum


def pad_columns(a: torch.Tensor, kp: int) -> torch.Tensor:
    """[T, K] -> [T, Kp], zero-padded (any dtype): the width the kernels read."""
    num_tokens, k = a.shape
    if k == kp:
        return a
    padded = torch.zeros(num_tokens, kp, dtype=a.dtype)
    padded[:, :k] = a
    return padded


# ---------------------------------------------------------------- decode + integer dots


@njit(nogil=True, cache=True, inline="always")
def _decode_codes(w: np.ndarray, r: int, buf: np.ndarray) -> None:
    """Row r of packed weights -> codes (t + 1, 0..2) in column order. buf [Kp]."""
    for g in range(w.shape[1] // GROUP_BYTES):
        for m in range(GROUP_BYTES):
            b = w[r, g * GROUP_BYTES + m]
            base = g * GROUP_COLS + m
            buf[base] = b >> 6
            buf[base + GROUP_BYTES] = (b >> 4) & 3
            buf[base + 2 * GROUP_BYTES] = (b >> 2) & 3
            buf[base + 3 * GROUP_BYTES] = b & 3


@njit(nogil=True, cache=True, inline="always")
def _dot(codes: np.ndarray, q: np.ndarray, start: int, stop: int) -> np.int32:
    """sum(codes[start:stop] * q[start:stop]) in int32.

    NOTE: the explicit int32 truncation each step keeps LLVM in 32-bit lanes (vpmaddwd); numba would
    otherwise widen to int64. No overflow: |sum| <= 2 * 128 * Kp < 2^31.
    """
    acc = np.int32(0)
    for k in range(start, stop):
        acc = np.int32(acc + np.int32(codes[k]) * np.int32(q[k]))
    return acc


@njit(parallel=True, nogil=True, cache=True)
def bitnet_linear_kernel(
    w: np.ndarray, qp: np.ndarray, q_sum: np.ndarray, s_act: np.ndarray, w_scale: np.float32, out: np.ndarray
) -> None:
    """Per-tensor scale. w uint8 [M, Kp/4], qp int16 [T, Kp], q_sum int32 [T], s_act f32 [T]
    -> out f32 [T, M].

    D = sum(code * q) - sum(q) exactly; y = f32(f32(f32(D) / s_act) * w_scale), one rounding per op.
    """
    m, kb = w.shape
    num_tokens, kp = qp.shape
    for task in prange((m + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        buf = np.empty(kp, dtype=np.int16)
        for r in range(task * ROWS_PER_TASK, min(m, (task + 1) * ROWS_PER_TASK)):
            _decode_codes(w, r, buf)
            for t in range(num_tokens):
                d = _dot(buf, qp[t], 0, kp) - q_sum[t]
                out[t, r] = (np.float32(d) / s_act[t]) * w_scale


@njit(parallel=True, nogil=True, cache=True)
def bitnet_block_linear_kernel(
    w: np.ndarray,
    qp: np.ndarray,
    block_q_sum: np.ndarray,
    s_act: np.ndarray,
    scale: np.ndarray,
    out: np.ndarray,
) -> None:
    """Per-block scales. block_q_sum int32 [T, nb], scale f32 [M, nb] -> out f32 [T, M].

    y = sum over blocks b in increasing order of f32(f32(f32(D_b) / s_act) * d_b), starting from +0.0,
    rounding after every add (the reference's order). A block spans Kp / nb columns.
    """
    m, kb = w.shape
    num_tokens, kp = qp.shape
    num_blocks = scale.shape[1]
    block_cols = kp // num_blocks
    for task in prange((m + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        buf = np.empty(kp, dtype=np.int16)
        for r in range(task * ROWS_PER_TASK, min(m, (task + 1) * ROWS_PER_TASK)):
            _decode_codes(w, r, buf)
            for t in range(num_tokens):
                qt = qp[t]
                y = np.float32(0.0)
                for b in range(num_blocks):
                    d = _dot(buf, qt, b * block_cols, (b + 1) * block_cols) - block_q_sum[t, b]
                    y = y + (np.float32(d) / s_act[t]) * scale[r, b]
                out[t, r] = y


@njit(parallel=True, nogil=True, cache=True)
def decode_values_f32(w: np.ndarray, r0: int, scale: np.ndarray, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) of packed weights -> f32 t * scale, column order. buf f32 [rows, Kp].

    scale f32 [M or 1, nb] (row 0 is used for every row when it has one row); a block spans Kp / nb
    columns. With scale 1 this gives exact t values for the exact f32 GEMM path.
    """
    kp = buf.shape[1]
    num_blocks = scale.shape[1]
    block_cols = kp // num_blocks
    for i in prange(buf.shape[0]):
        r = r0 + i
        sr = r if scale.shape[0] > 1 else 0
        for g in range(w.shape[1] // GROUP_BYTES):
            s = scale[sr, (g * GROUP_COLS) // block_cols]
            for m in range(GROUP_BYTES):
                b = np.int32(w[r, g * GROUP_BYTES + m])
                base = g * GROUP_COLS + m
                buf[i, base] = np.float32((b >> 6) - 1) * s
                buf[i, base + GROUP_BYTES] = np.float32(((b >> 4) & 3) - 1) * s
                buf[i, base + 2 * GROUP_BYTES] = np.float32(((b >> 2) & 3) - 1) * s
                buf[i, base + 3 * GROUP_BYTES] = np.float32((b & 3) - 1) * s


# ---------------------------------------------------------------- llamacpp-tq emulation


@intrinsic
def _fma_f32(typingctx: object, a: types.Type, b: types.Type, c: types.Type) -> tuple:
    """llvm.fma.f32: a * b + c with one rounding (hardware FMA, or libm fmaf where there is none)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: object, builder: object, signature: object, args: tuple) -> object:
        return builder.fma(*args)

    return sig, codegen


def tq_lane_order(k: int) -> torch.Tensor:
    """Natural column of each lane-major position: int64 [K].

    Lane-major order puts, per 256-block, the 32 columns of ggml's int32 lane L (columns 32c + 4L + r,
    c < 8, r < 4; see kernels/reference/ternary.py) at positions 32L .. 32L + 31.
    """
    return torch.arange(k).view(k // QK_K, 8, 8, 4).permute(0, 2, 1, 3).reshape(k)


@njit(parallel=True, nogil=True, cache=True)
def tq_linear_kernel(
    w: np.ndarray, q8l: np.ndarray, bsum_lanes: np.ndarray, d_x: np.ndarray, d_w: np.ndarray, out: np.ndarray
) -> None:
    """ggml_vec_dot_tq2_0_q8_K (AVX2) emulation; see kernels/reference/ternary.py for the order.

    w packed from lane-major columns (values[:, tq_lane_order(K)]), q8l int16 [T, K] Q8_K values in lane-major
    order, bsum_lanes int32 [T, nb, 8] (sum of q over natural columns 32L .. 32L + 31 of each block),
    d_x f32 [T, nb], d_w f32 [M, nb] -> out f32 [T, M].
    """
    m, kb = w.shape
    num_tokens, k = q8l.shape
    num_blocks = k // QK_K
    lane_cols = QK_K // NUM_TQ_LANES
    for task in prange((m + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        buf = np.empty(k, dtype=np.int16)
        acc = np.empty(NUM_TQ_LANES, dtype=np.float32)
        for r in range(task * ROWS_PER_TASK, min(m, (task + 1) * ROWS_PER_TASK)):
            _decode_codes(w, r, buf)
            for t in range(num_tokens):
                qt = q8l[t]
                acc[:] = 0.0
                for b in range(num_blocks):
                    d = d_x[t, b] * d_w[r, b]
                    for lane in range(NUM_TQ_LANES):
                        start = b * QK_K + lane * lane_cols
                        v = _dot(buf, qt, start, start + lane_cols) - bsum_lanes[t, b, lane]
                        acc[lane] = _fma_f32(np.float32(v), d, acc[lane])  # ggml's GCC build fuses
                lo = (acc[0] + acc[4]) + (acc[2] + acc[6])
                hi = (acc[1] + acc[5]) + (acc[3] + acc[7])
                out[t, r] = lo + hi
