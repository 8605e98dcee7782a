"""Q4_0 / Q4_1 / Q8_0 GEMV and GEMM on int8 activations, with x86 integer-dot instructions (and Q2_0 /
Q1_0 / Q5_0 / Q5_1 / Q2_K / Q4_K / Q5_K / Q6_K on the same tile: kernels/cpu/low_bit_records.py,
five_bit_records.py, k_quant_records.py).

Weights are the GGUF blocks, repacked at load into 4-row interleaved records (kernels/cpu/interleaved.py:
the layout, the repack and the tile):
- Q4_1: file blocks of 20 bytes (d f16, m f16, qs[16]: low nibble = value j, high nibble = value j + 16),
  w = code * d + m;
- Q4_0: 18-byte blocks (d f16, qs[16]), w = (code - 8) * d, run as Q4_1 with m = -8 d;
- Q8_0: 34-byte blocks (d f16, qs[32] int8), w = q * d.
Activations are quantized per 32-value block the way llama.cpp's Q8_1 is (quantize_block_q8 below): q
int8 [T, K], a scale dx per block and, for the Q4 min term, sx = dx * sum(q). Per (row, token, block)
the integer dot is exact (`vpmaddubsw` + `vpmaddwd` on AVX2, `vpdpbusd` on VNNI; code <= 15 and |q| <= 127
keep the int16 pairs far from saturation); then, as ggml's AVX2 `vec_dot_q4_1_q8_1` does, one f32 FMA per
block into 8 lanes, acc = fma(d * dx, f32(dot lanes), acc), the lanes summed once per row, plus the
scalar min term sum_b m_b * sx_b (fused multiply-adds, in block order). This changes the numerics of
Q4 / Q8_0 models toward llama.cpp's (the activations are rounded to int8); `block_activations="f32"`
keeps the exact-f32 kernels of kernels/cpu/blockquant.py. Not bit-exact with ggml: dx stays f32 (ggml
rounds it to f16), and ggml's lane split differs for some shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import literally, njit, prange

from bitserve.kernels.cpu.int8_tile import ISA_CODES
from bitserve.kernels.cpu.interleaved import (
    GROUP_ROWS,
    KIND_Q1_0,
    KIND_Q2_0,
    KIND_Q2_K,
    KIND_Q4_0,
    KIND_Q4_1,
    KIND_Q4_K,
    KIND_Q5_0,
    KIND_Q5_1,
    KIND_Q5_K,
    KIND_Q6_K,
    KIND_Q8_0,
    QK,
    _interleaved_body,
)
from bitserve.kernels.cpu.isa import Isa

__all__ = ["KIND_Q4_0", "KIND_Q4_1", "KIND_Q8_0", "KERNELS", "QK", "decode_rows", "padded_tokens"]

_AVX2, _VNNI = ISA_CODES[Isa.AVX2], ISA_CODES[Isa.VNNI]

# ---------------------------------------------------------------- activations


@njit(nogil=True, cache=True, inline="always")
def _quantize_token(x: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray) -> None:
    """One token: x f32 [K] -> q int8 [K], dx / sx f32 [nb] (see quantize_block_q8)."""
    for blk in range(x.shape[0] // QK):
        amax = np.float32(0.0)
        for j in range(blk * QK, blk * QK + QK):
            amax = max(amax, abs(x[j]))
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        total = 0
        for j in range(blk * QK, blk * QK + QK):
            v = np.int8(np.round(x[j] * inv))  # |x * inv| <= 127: no clamp needed
            q[j] = v
            total += v
        d = amax / np.float32(127.0)
        dx[blk] = d
        sx[blk] = d * np.float32(total)


@njit(nogil=True, cache=True)
def quantize_block_q8(x: np.ndarray, padded_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x f32 [T, K] -> (q int8 [padded_tokens, K], dx f32 [padded_tokens, nb], sx f32 [padded_tokens, nb]),
    zero rows as padding. Per 32-value block, as ggml's AVX2 quantize_row_q8_1: amax = max |x|,
    q = round_half_even(x * (127 / amax)) (0 for an all-zero block), dx = amax / 127, sx = dx * sum(q).
    Serial: decode-sized batches, where a parallel region's start costs more than the work."""
    num_tokens, k = x.shape
    q = np.zeros((padded_tokens, k), dtype=np.int8)
    dx = np.zeros((padded_tokens, k // QK), dtype=np.float32)
    sx = np.zeros((padded_tokens, k // QK), dtype=np.float32)
    for t in range(num_tokens):
        _quantize_token(x[t], q[t], dx[t], sx[t])
    return q, dx, sx


@njit(parallel=True, nogil=True, cache=True)
def q8_roundtrip(x: np.ndarray) -> np.ndarray:
    """x f32 [T, K] -> the values the kernels multiply, f32 [T, K]: q * dx per block (quantize_block_q8's
    arithmetic). Batches that take the sgemm path run on these, so a token's result does not depend on the
    size of its batch beyond f32 summation order. Parallel over tokens: these are prefill-sized batches."""
    num_tokens, k = x.shape
    out = np.empty_like(x)
    for t in prange(num_tokens):
        q = np.empty(k, dtype=np.int8)
        dx = np.empty(k // QK, dtype=np.float32)
        sx = np.empty(k // QK, dtype=np.float32)
        _quantize_token(x[t], q, dx, sx)
        for j in range(k):
            out[t, j] = np.float32(q[j]) * dx[j // QK]
    return out


# ---------------------------------------------------------------- kernels


# Thin entry points with the literals as constants: a Python caller then hits numba's compiled-signature fast
# path (the literal-typed body would be re-dispatched on every call). Module-level functions, not closures:
# numba's disk cache keys a function by its qualified name and line. Tiles (record groups x tokens): 1 x 1
# (4 rows, 1 token) for T = 1, 1 x 2 above (activations padded to an even count). Measured against the
# per-row file layout's tiles (4 rows x 1 token; 1 row x 4 tokens) on SmolLM2's layer shapes, CPU time, 1
# thread: 0.6x for T = 1 and 16 tokens; the 1 x 4 and 2 x 2 interleaved tiles were no faster than 1 x 2
# (benchmarks/RESULTS.md, "Issue 10: interleaved Q4 / Q8_0 records"). The tile changes no result: every
# (row, token) sum runs the same arithmetic in the same order.
GEMM_TOKENS = 2


def padded_tokens(num_tokens: int) -> int:
    """Rows of activations the kernel for num_tokens tokens reads (the quantizer pads with zero rows)."""
    if num_tokens <= 1:
        return num_tokens
    return -(-num_tokens // GEMM_TOKENS) * GEMM_TOKENS


@njit(nogil=True, cache=True)
def avx2_q4_1_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q4_1, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_1_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q4_1, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q4_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q4_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q8_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q8_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q8_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q8_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_1_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q4_1, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_1_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q4_1, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q4_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q4_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q8_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q8_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q8_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q8_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q2_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q2_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q2_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q2_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q1_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q1_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q1_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q1_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q2_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q2_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q2_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q2_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q1_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q1_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q1_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q1_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q5_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q5_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q5_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q5_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q5_1_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q5_1, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q5_1_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q5_1, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q5_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q5_0, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q5_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q5_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q5_1_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q5_1, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q5_1_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q5_1, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q4_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q4_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q4_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q4_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q5_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q5_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q5_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q5_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q5_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q5_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q5_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q5_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q6_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q6_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q6_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q6_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q6_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q6_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q6_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q6_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q2_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q2_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q2_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_AVX2, KIND_Q2_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q2_k_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q2_K, 1, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q2_k_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _interleaved_body(_VNNI, KIND_Q2_K, 1, GEMM_TOKENS, w, q, dx, sx, out)


# ---------------------------------------------------------------- any kind, chosen per call


@njit(nogil=True, cache=True)
def _kind_tile(
    isa: int, kind: int, w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray
) -> None:
    """The kind's entry point (gemv for one token, gemm above), as the named ones above run it."""
    literally(isa)
    literally(kind)
    if out.shape[0] == 1:
        _interleaved_body(isa, kind, 1, 1, w, q, dx, sx, out)
    else:
        _interleaved_body(isa, kind, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def _any_kind(
    isa: int, kind: int, w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray
) -> None:
    """Records w of any kind (KIND_Q4_1 ...: a run-time value, one branch each) -> out f32 [T, M]: what
    the one-call step of a model mixing block formats runs (kernels/cpu/block_step.MixedBlockStep)."""
    literally(isa)
    if kind == KIND_Q4_1:
        _kind_tile(isa, KIND_Q4_1, w, q, dx, sx, out)
    elif kind == KIND_Q4_0:
        _kind_tile(isa, KIND_Q4_0, w, q, dx, sx, out)
    elif kind == KIND_Q8_0:
        _kind_tile(isa, KIND_Q8_0, w, q, dx, sx, out)
    elif kind == KIND_Q2_0:
        _kind_tile(isa, KIND_Q2_0, w, q, dx, sx, out)
    elif kind == KIND_Q1_0:
        _kind_tile(isa, KIND_Q1_0, w, q, dx, sx, out)
    elif kind == KIND_Q5_0:
        _kind_tile(isa, KIND_Q5_0, w, q, dx, sx, out)
    elif kind == KIND_Q5_1:
        _kind_tile(isa, KIND_Q5_1, w, q, dx, sx, out)
    elif kind == KIND_Q4_K:
        _kind_tile(isa, KIND_Q4_K, w, q, dx, sx, out)
    elif kind == KIND_Q5_K:
        _kind_tile(isa, KIND_Q5_K, w, q, dx, sx, out)
    elif kind == KIND_Q6_K:
        _kind_tile(isa, KIND_Q6_K, w, q, dx, sx, out)
    elif kind == KIND_Q2_K:
        _kind_tile(isa, KIND_Q2_K, w, q, dx, sx, out)
    else:
        raise ValueError("unknown block kind")


@njit(nogil=True, cache=True)
def avx2_any_kind(
    kind: int, w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray
) -> None:
    _any_kind(_AVX2, kind, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_any_kind(
    kind: int, w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray
) -> None:
    _any_kind(_VNNI, kind, w, q, dx, sx, out)


ANY_KIND = {Isa.AVX2: avx2_any_kind, Isa.VNNI: vnni_any_kind}


@dataclass(frozen=True)
class BlockKernels:
    """One (ISA, block kind)'s entry points on interleaved records (interleaved.repack): gemv for T = 1,
    gemm above (q padded as padded_tokens says)."""

    gemv: Callable[..., None]
    gemm: Callable[..., None]

    def for_tokens(self, num_tokens: int) -> Callable[..., None]:
        return self.gemv if num_tokens == 1 else self.gemm


KERNELS = {
    (Isa.AVX2, "q4_1"): BlockKernels(avx2_q4_1_gemv, avx2_q4_1_gemm),
    (Isa.AVX2, "q4_0"): BlockKernels(avx2_q4_0_gemv, avx2_q4_0_gemm),
    (Isa.AVX2, "q8_0"): BlockKernels(avx2_q8_0_gemv, avx2_q8_0_gemm),
    (Isa.VNNI, "q4_1"): BlockKernels(vnni_q4_1_gemv, vnni_q4_1_gemm),
    (Isa.VNNI, "q4_0"): BlockKernels(vnni_q4_0_gemv, vnni_q4_0_gemm),
    (Isa.VNNI, "q8_0"): BlockKernels(vnni_q8_0_gemv, vnni_q8_0_gemm),
    (Isa.AVX2, "q2_0"): BlockKernels(avx2_q2_0_gemv, avx2_q2_0_gemm),
    (Isa.AVX2, "q1_0"): BlockKernels(avx2_q1_0_gemv, avx2_q1_0_gemm),
    (Isa.VNNI, "q2_0"): BlockKernels(vnni_q2_0_gemv, vnni_q2_0_gemm),
    (Isa.VNNI, "q1_0"): BlockKernels(vnni_q1_0_gemv, vnni_q1_0_gemm),
    (Isa.AVX2, "q5_0"): BlockKernels(avx2_q5_0_gemv, avx2_q5_0_gemm),
    (Isa.AVX2, "q5_1"): BlockKernels(avx2_q5_1_gemv, avx2_q5_1_gemm),
    (Isa.VNNI, "q5_0"): BlockKernels(vnni_q5_0_gemv, vnni_q5_0_gemm),
    (Isa.VNNI, "q5_1"): BlockKernels(vnni_q5_1_gemv, vnni_q5_1_gemm),
    (Isa.AVX2, "q4_k"): BlockKernels(avx2_q4_k_gemv, avx2_q4_k_gemm),
    (Isa.VNNI, "q4_k"): BlockKernels(vnni_q4_k_gemv, vnni_q4_k_gemm),
    (Isa.AVX2, "q5_k"): BlockKernels(avx2_q5_k_gemv, avx2_q5_k_gemm),
    (Isa.VNNI, "q5_k"): BlockKernels(vnni_q5_k_gemv, vnni_q5_k_gemm),
    (Isa.AVX2, "q6_k"): BlockKernels(avx2_q6_k_gemv, avx2_q6_k_gemm),
    (Isa.VNNI, "q6_k"): BlockKernels(vnni_q6_k_gemv, vnni_q6_k_gemm),
    (Isa.AVX2, "q2_k"): BlockKernels(avx2_q2_k_gemv, avx2_q2_k_gemm),
    (Isa.VNNI, "q2_k"): BlockKernels(vnni_q2_k_gemv, vnni_q2_k_gemm),
}


# ---------------------------------------------------------------- f32 rows for the sgemm path


@njit(parallel=True, nogil=True, cache=True)
def decode_rows(w: np.ndarray, d: np.ndarray, m: np.ndarray, is_q8: bool, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) of records w uint8 [G, nb, record] -> buf f32 [rows, K]: q * d (Q8_0) or
    code * d + m (Q4_*; two roundings, as ggml's Q4_1). d, m f32 [M, nb] (m unused for Q8_0)."""
    num_blocks = d.shape[1]
    for i in prange(buf.shape[0]):
        r = r0 + i
        g, slot = r // GROUP_ROWS, 8 * (r % GROUP_ROWS)
        for blk in range(num_blocks):
            db = d[r, blk]
            base = blk * QK
            if is_q8:
                for j in range(QK // 8):
                    for v in range(8):
                        buf[i, base + 8 * j + v] = np.float32(np.int8(w[g, blk, 32 * j + slot + v])) * db
            else:
                mb = m[r, blk]
                for j in range(2):
                    for v in range(8):
                        byte = np.int32(w[g, blk, 32 * j + slot + v])
                        buf[i, base + 8 * j + v] = np.float32(byte & np.int32(15)) * db + mb
                        buf[i, base + QK // 2 + 8 * j + v] = np.float32(byte >> np.int32(4)) * db + mb
