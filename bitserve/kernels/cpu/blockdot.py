"""Q4_0 / Q4_1 / Q8_0 GEMV and GEMM on int8 activations, with x86 integer-dot instructions.

Weights stay in the GGUF block format, rows as the file stores them (uint8 [M, nb * type_size]):
- Q4_1: 20-byte blocks (d f16, m f16, qs[16]: low nibble = value j, high nibble = value j + 16),
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

Like int8dot.py, the tile is an `@intrinsic` writing its loop in LLVM IR, compiled only where the ISA
variant runs (kernels/cpu/isa.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bitserve.kernels.cpu.int8dot import (
    ISA_CODES,
    PREFETCH_BYTES,
    _declare,
    _is_c_matrix,
    _splat,
    padded_token_count,
)
from bitserve.kernels.cpu.isa import Isa

QK = 32  # values per block
KIND_Q4_1, KIND_Q4_0, KIND_Q8_0 = 1, 2, 3  # the `kind` literal the kernels take
TYPE_SIZES = {KIND_Q4_1: 20, KIND_Q4_0: 18, KIND_Q8_0: 34}  # bytes per block in the file
ROWS_PER_TASK = 16  # rows per prange task: 16 x 864 B (Q4_1, K = 1536) of codes stay in L1 across tokens
TOKEN_BLOCK = 32  # tokens per pass over a task's rows
_AVX2, _VNNI = ISA_CODES[Isa.AVX2], ISA_CODES[Isa.VNNI]

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F16, _F32 = ir.HalfType(), ir.FloatType()
_V16xI8 = ir.VectorType(_I8, 16)
_V32xI8 = ir.VectorType(_I8, 32)
_V16xI16 = ir.VectorType(_I16, 16)
_V8xI32 = ir.VectorType(_I32, 8)
_V8xF32 = ir.VectorType(_F32, 8)


class _BlockTileEmitter:
    """IR of one tile: rows x toks f32 dot products over all blocks of a row (see the module docstring)."""

    def __init__(self, builder: ir.IRBuilder, kind: int, isa: int, row_ptrs: list, tok_ptrs: list) -> None:
        self.b = builder
        self.kind = kind
        self.isa = isa
        self.row_ptrs = row_ptrs  # i8* of each row's first block
        self.tok_ptrs = tok_ptrs  # (q i8*, dx f32*, sx f32*) of each token

    def f16_at(self, base: ir.Value, offset: ir.Value) -> ir.Value:
        ptr = self.b.bitcast(self.b.gep(base, [offset]), _F16.as_pointer())
        return self.b.fpext(self.b.load(ptr, align=1), _F32)

    def load_vector(self, base: ir.Value, offset: ir.Value, vector_type: ir.VectorType) -> ir.Value:
        ptr = self.b.bitcast(self.b.gep(base, [offset]), vector_type.as_pointer())
        return self.b.load(ptr, align=1)

    def row_block(
        self, ptr: ir.Value, block: ir.Value
    ) -> tuple[ir.Value, ir.Value, ir.Value | None, ir.Value]:
        """-> (unsigned codes <32 x i8>, d, m or None, signs <32 x i8> or None) of one row's block."""
        b = self.b
        type_size = TYPE_SIZES[self.kind]
        start = b.mul(block, ir.Constant(block.type, type_size))
        prefetch = _declare(b, "llvm.prefetch.p0", ir.VoidType(), _I8.as_pointer(), _I32, _I32, _I32)
        ahead = b.gep(ptr, [b.add(start, ir.Constant(block.type, PREFETCH_BYTES))])
        b.call(prefetch, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        d = self.f16_at(ptr, start)
        if self.kind == KIND_Q8_0:
            values = self.load_vector(ptr, b.add(start, ir.Constant(block.type, 2)), _V32xI8)
            absolute = b.call(
                _declare(b, "llvm.abs.v32i8", _V32xI8, _V32xI8, ir.IntType(1)),
                [values, ir.Constant(ir.IntType(1), 0)],
            )
            return absolute, d, None, values  # u8 |w| (128 for -128), signs from w
        qs_offset = 4 if self.kind == KIND_Q4_1 else 2
        packed = self.load_vector(ptr, b.add(start, ir.Constant(block.type, qs_offset)), _V16xI8)
        low = b.and_(packed, _splat(_V16xI8, 15))
        high = b.lshr(packed, _splat(_V16xI8, 4))
        codes = b.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        if self.kind == KIND_Q4_1:
            m = self.f16_at(ptr, b.add(start, ir.Constant(block.type, 2)))
        else:  # Q4_0: (code - 8) d = code d + (-8 d), exact in f32
            m = b.fmul(d, ir.Constant(_F32, -8.0))
        return codes, d, m, None

    def integer_dot(self, codes: ir.Value, acts: ir.Value) -> ir.Value:
        """u8 codes x s8 acts -> <8 x i32> lane sums of 4 products each."""
        b = self.b
        if self.isa == _VNNI:
            dpbusd = _declare(b, "llvm.x86.avx512.vpdpbusd.256", _V8xI32, _V8xI32, _V8xI32, _V8xI32)
            return b.call(dpbusd, [_splat(_V8xI32, 0), b.bitcast(codes, _V8xI32), b.bitcast(acts, _V8xI32)])
        maddubs = _declare(b, "llvm.x86.avx2.pmadd.ub.sw", _V16xI16, _V32xI8, _V32xI8)
        maddwd = _declare(b, "llvm.x86.avx2.pmadd.wd", _V8xI32, _V16xI16, _V16xI16)
        return b.call(maddwd, [b.call(maddubs, [codes, acts]), _splat(_V16xI16, 1)])

    def emit(self, num_blocks: ir.Value) -> list[ir.Value]:
        """-> f32 per (row, token) pair, row-major: hsum(lane accumulators) + min term."""
        b = self.b
        fma = _declare(b, "llvm.fma.v8f32", _V8xF32, _V8xF32, _V8xF32, _V8xF32)
        num_toks = len(self.tok_ptrs)
        per_token = ir.VectorType(_F32, num_toks)  # lane t: token t
        fma_tokens = _declare(b, f"llvm.fma.v{num_toks}f32", per_token, per_token, per_token, per_token)
        pairs = [(r, t) for r in range(len(self.row_ptrs)) for t in range(num_toks)]
        accs = [
            cgutils.alloca_once_value(b, ir.Constant(_V8xF32, [ir.Constant(_F32, 0.0)] * 8)) for _ in pairs
        ]
        # the min terms of a row's tokens in one vector: per lane the same FMA chain in block order as a
        # scalar per pair, but one register a row (scalars took one a pair and spilled wider tiles)
        zeros = ir.Constant(per_token, [ir.Constant(_F32, 0.0)] * num_toks)
        mins = [cgutils.alloca_once_value(b, zeros) for _ in self.row_ptrs]
        with cgutils.for_range(b, num_blocks) as loop:
            block = loop.index
            rows = [self.row_block(ptr, block) for ptr in self.row_ptrs]
            toks = []
            sx_lanes = zeros
            for t, (q_ptr, dx_ptr, sx_ptr) in enumerate(self.tok_ptrs):
                acts = self.load_vector(q_ptr, b.mul(block, ir.Constant(block.type, QK)), _V32xI8)
                toks.append((acts, b.load(b.gep(dx_ptr, [block]))))
                if self.kind != KIND_Q8_0:
                    sx = b.load(b.gep(sx_ptr, [block]))
                    sx_lanes = b.insert_element(sx_lanes, sx, ir.Constant(_I32, t))
            for slot, (r, t) in zip(accs, pairs, strict=True):
                codes, d, _, signs = rows[r]
                acts, dx = toks[t]
                if signs is not None:  # Q8_0: |w| * (q with w's sign); w = 0 gives 0 either way
                    negative = b.icmp_signed("<", signs, _splat(_V32xI8, 0))
                    acts = b.select(negative, b.sub(_splat(_V32xI8, 0), acts), acts)
                lanes = b.sitofp(self.integer_dot(codes, acts), _V8xF32)
                b.store(b.call(fma, [_broadcast(b, b.fmul(d, dx), _V8xF32), lanes, b.load(slot)]), slot)
            for min_slot, (_, _, m, _) in zip(mins, rows, strict=True):
                if m is not None:  # one FMA, not a multiply and an add: ~6% of the GEMV's time (measured)
                    m_lanes = _broadcast(b, m, per_token)
                    b.store(b.call(fma_tokens, [m_lanes, sx_lanes, b.load(min_slot)]), min_slot)
        row_mins = [b.load(slot) for slot in mins]
        return [
            b.fadd(_hsum8(b, b.load(slot)), b.extract_element(row_mins[r], ir.Constant(_I32, t)))
            for slot, (r, t) in zip(accs, pairs, strict=True)
        ]


def _broadcast(b: ir.IRBuilder, value: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    """A scalar in every lane of vector_type."""
    first = b.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count)
    return b.shuffle_vector(first, first, zeros)


def _hsum8(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """ggml's hsum_float_8 order: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    lane = [b.extract_element(v, ir.Constant(_I32, i)) for i in range(8)]
    return b.fadd(
        b.fadd(b.fadd(lane[0], lane[4]), b.fadd(lane[2], lane[6])),
        b.fadd(b.fadd(lane[1], lane[5]), b.fadd(lane[3], lane[7])),
    )


@intrinsic
def _block_tile(
    typingctx: object,
    isa: types.Type,
    kind: types.Type,
    rows: types.Type,
    toks: types.Type,
    w: types.Type,
    w_row: types.Type,
    q: types.Type,
    dx: types.Type,
    sx: types.Type,
    q_row: types.Type,
) -> tuple | None:
    """_block_tile(isa, kind, rows, toks, w, w_row, q, dx, sx, q_row) -> UniTuple(float32, rows * toks).

    isa, kind, rows, toks: integer literals. w uint8 [M, nb * type_size], q int8 [Tp, K], dx / sx f32
    [Tp, nb], all C order. Entry r * toks + t is row w_row + r . token q_row + t.
    """
    literals = (isa, kind, rows, toks)
    if not all(isinstance(v, types.IntegerLiteral) for v in literals):
        return None
    if not (_is_c_matrix(w, types.uint8) and _is_c_matrix(q, types.int8)):
        return None
    if not (_is_c_matrix(dx, types.float32) and _is_c_matrix(sx, types.float32)):
        return None
    isa_code, kind_code, num_rows, num_toks = (v.literal_value for v in literals)
    sig = types.UniTuple(types.float32, num_rows * num_toks)(
        isa, kind, rows, toks, w, w_row, q, dx, sx, q_row
    )

    def codegen(context: object, builder: ir.IRBuilder, signature: object, llargs: tuple) -> ir.Value:
        w_val, w_row_val, q_val, dx_val, sx_val, q_row_val = llargs[4:]
        w_arr = context.make_array(w)(context, builder, w_val)
        q_arr = context.make_array(q)(context, builder, q_val)
        dx_arr = context.make_array(dx)(context, builder, dx_val)
        sx_arr = context.make_array(sx)(context, builder, sx_val)
        w_stride = builder.extract_value(w_arr.strides, 0)  # bytes per weight row
        q_stride = builder.extract_value(q_arr.strides, 0)
        num_blocks = builder.extract_value(dx_arr.shape, 1)
        w_base = builder.gep(w_arr.data, [builder.mul(w_row_val, w_stride)])
        row_ptrs = [
            builder.gep(w_base, [builder.mul(w_stride, ir.Constant(w_stride.type, r))])
            for r in range(num_rows)
        ]
        tok_ptrs = []
        for t in range(num_toks):
            tok = builder.add(q_row_val, ir.Constant(q_row_val.type, t))
            q_ptr = builder.gep(q_arr.data, [builder.mul(tok, q_stride)])
            dx_ptr = builder.gep(dx_arr.data, [builder.mul(tok, num_blocks)])
            sx_ptr = builder.gep(sx_arr.data, [builder.mul(tok, num_blocks)])
            tok_ptrs.append((q_ptr, dx_ptr, sx_ptr))
        emitter = _BlockTileEmitter(builder, kind_code, isa_code, row_ptrs, tok_ptrs)
        sums = emitter.emit(num_blocks)
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


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


@njit(parallel=True, nogil=True, cache=True)
def _block_body(
    isa: int,
    kind: int,
    rows: int,
    toks: int,
    w: np.ndarray,
    q: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    out: np.ndarray,
) -> None:
    """w uint8 [M, row_bytes] (file blocks), q int8 [Tp, K], dx / sx f32 [Tp, nb] -> out f32 [T, M].
    Per task, TOKEN_BLOCK tokens at a time over the task's rows: each weight byte comes from memory once
    per step (the task's rows stay in L1/L2 across token blocks)."""
    literally(isa)
    literally(kind)
    literally(rows)
    literally(toks)
    m = out.shape[1]
    for task in prange((m + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        r_start = task * ROWS_PER_TASK
        r_end = min(m, r_start + ROWS_PER_TASK)
        full_end = r_start + (r_end - r_start) // rows * rows
        for t_block in range(0, q.shape[0], TOKEN_BLOCK):
            t_end = min(q.shape[0], t_block + TOKEN_BLOCK)
            for r in range(r_start, full_end, rows):
                for t0 in range(t_block, t_end, toks):
                    y = _block_tile(isa, kind, rows, toks, w, r, q, dx, sx, t0)
                    _store(y, rows, toks, r, t0, out)
            for r in range(full_end, r_end):
                for t0 in range(t_block, t_end, toks):
                    y1 = _block_tile(isa, kind, 1, toks, w, r, q, dx, sx, t0)
                    _store(y1, 1, toks, r, t0, out)


@njit(nogil=True, cache=True, inline="always")
def _store(y: tuple, rows: int, toks: int, r0: int, t0: int, out: np.ndarray) -> None:
    for t in range(t0, min(t0 + toks, out.shape[0])):
        for i in range(rows):
            out[t, r0 + i] = y[i * toks + t - t0]


# Thin entry points with the literals as constants: a Python caller then hits numba's compiled-signature fast
# path (the literal-typed body would be re-dispatched on every call). Module-level functions, not closures:
# numba's disk cache keys a function by its qualified name and line. Tiles: 4 rows x 1 token for T = 1,
# 2 rows x 2 tokens for T = 2, 1 row x GEMM_TOKENS tokens above (activations padded to a multiple of
# GEMM_TOKENS rows). Why 1 x 4 for batches: with the min terms in one vector a row it reads each row's
# unpacked block once for 4 tokens at ~8 live registers (2 x 4 and 4 x 4 spill); CPU time against 2 x 2:
# 0.77x at 16 tokens and 0.87x at 8 on SmolLM2's layer shapes, 0.87x of the layers' GEMM time in its
# 16-sequence decode step (benchmarks/RESULTS.md, "Issue 10: batched decode"). The tile changes no
# result: every (row, token) sum runs the same instructions in the same order.
PAIR_TOKENS = 2
GEMM_TOKENS = 4


def padded_tokens(num_tokens: int) -> int:
    """Rows of activations the kernel for num_tokens tokens reads (the quantizer pads with zero rows)."""
    if num_tokens <= PAIR_TOKENS:
        return num_tokens
    return padded_token_count(num_tokens, GEMM_TOKENS)


@njit(nogil=True, cache=True)
def avx2_q4_1_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q4_1, 4, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_1_gemm2(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q4_1, 2, PAIR_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_1_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q4_1, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q4_0, 4, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_0_gemm2(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q4_0, 2, PAIR_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q4_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q4_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q8_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q8_0, 4, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q8_0_gemm2(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q8_0, 2, PAIR_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def avx2_q8_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_AVX2, KIND_Q8_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_1_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q4_1, 4, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_1_gemm2(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q4_1, 2, PAIR_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_1_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q4_1, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q4_0, 4, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_0_gemm2(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q4_0, 2, PAIR_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q4_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q4_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q8_0_gemv(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q8_0, 4, 1, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q8_0_gemm2(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q8_0, 2, PAIR_TOKENS, w, q, dx, sx, out)


@njit(nogil=True, cache=True)
def vnni_q8_0_gemm(w: np.ndarray, q: np.ndarray, dx: np.ndarray, sx: np.ndarray, out: np.ndarray) -> None:
    _block_body(_VNNI, KIND_Q8_0, 1, GEMM_TOKENS, w, q, dx, sx, out)


@dataclass(frozen=True)
class BlockKernels:
    """One (ISA, block kind)'s entry points: gemv for T = 1, gemm2 for T = 2, gemm above (q padded as
    padded_tokens says)."""

    gemv: Callable[..., None]
    gemm2: Callable[..., None]
    gemm: Callable[..., None]

    def for_tokens(self, num_tokens: int) -> Callable[..., None]:
        if num_tokens == 1:
            return self.gemv
        return self.gemm2 if num_tokens == PAIR_TOKENS else self.gemm


KERNELS = {
    (Isa.AVX2, "q4_1"): BlockKernels(avx2_q4_1_gemv, avx2_q4_1_gemm2, avx2_q4_1_gemm),
    (Isa.AVX2, "q4_0"): BlockKernels(avx2_q4_0_gemv, avx2_q4_0_gemm2, avx2_q4_0_gemm),
    (Isa.AVX2, "q8_0"): BlockKernels(avx2_q8_0_gemv, avx2_q8_0_gemm2, avx2_q8_0_gemm),
    (Isa.VNNI, "q4_1"): BlockKernels(vnni_q4_1_gemv, vnni_q4_1_gemm2, vnni_q4_1_gemm),
    (Isa.VNNI, "q4_0"): BlockKernels(vnni_q4_0_gemv, vnni_q4_0_gemm2, vnni_q4_0_gemm),
    (Isa.VNNI, "q8_0"): BlockKernels(vnni_q8_0_gemv, vnni_q8_0_gemm2, vnni_q8_0_gemm),
}


# ---------------------------------------------------------------- f32 rows for the sgemm path


@njit(parallel=True, nogil=True, cache=True)
def decode_rows(w: np.ndarray, d: np.ndarray, m: np.ndarray, is_q8: bool, r0: int, buf: np.ndarray) -> None:
    """Rows r0 .. r0 + len(buf) of w uint8 [M, row_bytes] -> buf f32 [rows, K]: q * d (Q8_0) or
    code * d + m (Q4_*; two roundings, as ggml's Q4_1). d, m f32 [M, nb] (m unused for Q8_0)."""
    num_blocks = d.shape[1]
    type_size = w.shape[1] // num_blocks
    for i in prange(buf.shape[0]):
        r = r0 + i
        for blk in range(num_blocks):
            start = blk * type_size
            db = d[r, blk]
            if is_q8:
                for j in range(QK):
                    buf[i, blk * QK + j] = np.float32(np.int8(w[r, start + 2 + j])) * db
            else:
                mb = m[r, blk]
                qs = start + type_size - QK // 2
                for j in range(QK // 2):
                    byte = np.int32(w[r, qs + j])
                    buf[i, blk * QK + j] = np.float32(byte & np.int32(15)) * db + mb
                    buf[i, blk * QK + QK // 2 + j] = np.float32(byte >> np.int32(4)) * db + mb
