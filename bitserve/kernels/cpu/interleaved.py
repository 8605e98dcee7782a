"""Q4_0 / Q4_1 / Q8_0 weights repacked at load into 4-row interleaved blocks, and the int8 tile on them.

The arithmetic is kernels/cpu/blockdot.py's, bit for bit: per (row, token, 32-value block) eight int32 lane
sums of four code * q products each (lane l: values 4l .. 4l + 3), converted to f32 and accumulated with one
FMA by d * dx into that (row, token)'s lane l, the lanes summed once in ggml's hsum_float_8 order, plus the
min term's FMA chain in block order. Only where the lanes sit in the registers changes, and with it the
work per (row, token, block): a block of 4 rows stores the rows' 8-value runs side by side, so one 32-byte
vector holds two lanes of each of the 4 rows, and one broadcast 8-byte run of activations meets all 4
(ggml's repacked `block_q4_0x4` idea). Each (rows, token, block) then needs no per-row scalar scale and
broadcast (d * dx is one vector multiply for 4 rows), and a 4-row x 2-token tile unpacks each nibble
once for both tokens at 8 accumulators (16 ymm registers): what the per-row file layout could not fit.

Record of one block of 4 rows (GROUP_ROWS), uint8 [RECORD_BYTES[kind]], records as [groups, nb, record]:
- codes: 4 vectors of 32 bytes; in vector j, bytes 8r .. 8r + 7 are row r's values 8j .. 8j + 7, so after
  the integer dot its int32 slots 2r, 2r + 1 are row r's lanes 2j, 2j + 1. Q4 stores the nibbles as the
  file does (2 vectors: low nibbles are vectors 0 and 1, high nibbles vectors 2 and 3); Q8_0 its int8 values.
- d of the 4 rows (f16, as in the file), then for Q4_1 their m (f16); Q4_0's m = -8 d is made in the kernel.
Rows are padded to a multiple of 4 with zero rows (their outputs are never stored). Memory: 20 bytes per
row-block for Q4_1 (the file's own size), 18 for Q4_0, 34 for Q8_0: the same as the copy of the file's
rows it replaces.

Q5_0 / Q5_1 records add, after the two nibble vectors, a vector H whose byte 8r + i holds bit 8j + i of
row r's qh as its bit j (j < 4), then d (and Q5_1's m): 104 / 112 bytes for the file's 88 / 96. Code
vector j is nibble vector j | ((H >> j) & 1) << 4; values (code - 16) d, or code d + m.

Q4_K records span one super-block (256 values, 8 sub-blocks of 32) of 4 rows: for each sub-block pair g,
4 vectors whose byte 8r + i is qs[32 g + 8 p + i] of row r (low nibbles: sub-block 2g, high: 2g + 1), then
the 6-bit scales and mins unpacked to bytes (sub-block s's 4 rows at 512 + 4 s and 544 + 4 s), then d and
dmin f16 [4]: 592 bytes for the file's 576. Values (d sc) code - (dmin m). Q2_K records (336 bytes, the
file's own): a packed vector per activation block b (byte 8r + i: value 32 b + 8 j + i's code at bits 2 j),
the file's scale bytes (16-value sub-block t's 4 rows at 256 + 4 t: scale | min << 4), d and dmin f16 [4];
values (d sc) code - (dmin m) per 16, the min term as FMAs of the activations' lane sums.

Q2_0 (64 values a block) and Q1_0 (128) records span one file block of 4 rows, so 2 or 4 activation
blocks: 2 packed vectors of 32 bytes, then d f16 [4] (72 bytes, the file's own size). Code vector v
(values 8v .. 8v + 7 of the block, bytes 8r .. 8r + 7 for row r, as above) is (P[v // 4] >> 2 (v % 4)) & 3
for Q2_0 and (P[v // 8] >> (v % 8)) & 1 for Q1_0 (low_bit_records.repack_low_bit). Their values run
as Q4_0's do, a code times a scale plus a min: Q2_0 (c - 1) d = c d + (-d), Q1_0 (2c - 1) d =
c (2d) + (-d), both products exact in f32.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bitserve.kernels.cpu import k_quant_tile
from bitserve.kernels.cpu.int8_tile import ISA_CODES, PREFETCH_BYTES, _declare, _is_c_matrix, _splat
from bitserve.kernels.cpu.isa import Isa

QK = 32  # values per activation block
# the `kind` literal the kernels take; Q2_0 / Q1_0 records: kernels/cpu/low_bit_records.py, Q5_0 / Q5_1:
# five_bit_records.py, Q2_K / Q4_K / Q5_K / Q6_K: k_quant_records.py (their IR: k_quant_tile.py)
(
    KIND_Q4_1,
    KIND_Q4_0,
    KIND_Q8_0,
    KIND_Q2_0,
    KIND_Q1_0,
    KIND_Q5_0,
    KIND_Q5_1,
    KIND_Q4_K,
    KIND_Q6_K,
    KIND_Q5_K,
    KIND_Q2_K,
) = range(1, 12)
GROUP_ROWS = 4  # rows interleaved in one record
CODE_VECTORS = 4  # 32-byte code vectors per 32-value block after unpacking (2 lanes of each row each)
# by kind: bytes per file block; bytes per record (4 rows' file blocks); where d f16 [4] sits (Q4_1's and
# Q5_1's m, Q4_K's dmin after it); the 32-value activation blocks a record spans
TYPE_SIZES = (0, 20, 18, 34, 18, 18, 22, 24, 144, 210, 176, 84)
RECORD_BYTES = (0, 80, 72, 136, 72, 72, 104, 112, 592, 840, 720, 336)
SCALES_AT = (0, 64, 64, 128, 64, 64, 96, 96, 576, 832, 576, 320)
BLOCKS_PER_RECORD = (0, 1, 1, 1, 2, 4, 1, 1, 8, 8, 8, 8)
ROWS_PER_TASK = 16  # rows per prange task (4 records per block): a multiple of every tile's rows
TOKEN_BLOCK = 32  # tokens per pass over a task's rows
_AVX2, _VNNI = ISA_CODES[Isa.AVX2], ISA_CODES[Isa.VNNI]

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F16, _F32 = ir.HalfType(), ir.FloatType()
_V32xI8 = ir.VectorType(_I8, 32)
_V16xI16 = ir.VectorType(_I16, 16)
_V8xI32 = ir.VectorType(_I32, 8)
_V4xI64 = ir.VectorType(_I64, 4)
_V4xF16 = ir.VectorType(_F16, 4)
_V4xF32 = ir.VectorType(_F32, 4)
_V8xF32 = ir.VectorType(_F32, 8)


# ---------------------------------------------------------------- repack at load


@njit(nogil=True, cache=True, inline="always")
def record_slot(row: int) -> tuple[int, int]:
    """Row -> (its record group, the first byte of its 8-byte run in a code vector)."""
    return row // GROUP_ROWS, 8 * (row % GROUP_ROWS)


@njit(nogil=True, cache=True)
def empty_records(num_rows: int, num_blocks: int, kind: int) -> np.ndarray:
    """Zeroed records uint8 [ceil(num_rows / 4), num_blocks, RECORD_BYTES[kind]] (zero padding rows)."""
    return np.zeros(
        ((num_rows + GROUP_ROWS - 1) // GROUP_ROWS, num_blocks, RECORD_BYTES[kind]), dtype=np.uint8
    )


@njit(nogil=True, cache=True)
def repack(rows: np.ndarray, kind: int) -> np.ndarray:
    """File rows uint8 [M, nb * type_size] -> records uint8 [ceil(M / 4), nb, RECORD_BYTES[kind]]."""
    num_rows = rows.shape[0]
    type_size, record, scales_at = TYPE_SIZES[kind], RECORD_BYTES[kind], SCALES_AT[kind]
    num_blocks = rows.shape[1] // type_size
    num_groups = (num_rows + GROUP_ROWS - 1) // GROUP_ROWS
    out = np.zeros((num_groups, num_blocks, record), dtype=np.uint8)
    codes_at = 4 if kind == KIND_Q4_1 else 2  # the block's qs after d (and m)
    run_count = scales_at // (8 * GROUP_ROWS)  # 8-byte runs of a row's block: 2 (Q4) or 4 (Q8_0)
    for row in range(num_rows):
        g, r = row // GROUP_ROWS, row % GROUP_ROWS
        for blk in range(num_blocks):
            src = blk * type_size
            for j in range(run_count):
                for i in range(8):
                    out[g, blk, 32 * j + 8 * r + i] = rows[row, src + codes_at + 8 * j + i]
            for i in range(2):
                out[g, blk, scales_at + 2 * r + i] = rows[row, src + i]  # d
                if kind == KIND_Q4_1:
                    out[g, blk, scales_at + 2 * GROUP_ROWS + 2 * r + i] = rows[row, src + 2 + i]  # m
    return out


KINDS = {
    "q4_1": KIND_Q4_1,
    "q4_0": KIND_Q4_0,
    "q8_0": KIND_Q8_0,
    "q2_0": KIND_Q2_0,
    "q1_0": KIND_Q1_0,
    "q5_0": KIND_Q5_0,
    "q5_1": KIND_Q5_1,
    "q4_k": KIND_Q4_K,
    "q6_k": KIND_Q6_K,
    "q5_k": KIND_Q5_K,
    "q2_k": KIND_Q2_K,
}


# ---------------------------------------------------------------- the tile


class _InterleavedTileEmitter:
    """IR of one tile: groups x 4 rows x toks f32 dot products over all blocks (see the module docstring)."""

    def __init__(self, builder: ir.IRBuilder, kind: int, isa: int, group_ptrs: list, tok_ptrs: list) -> None:
        self.b = builder
        self.kind = kind
        self.isa = isa
        self.group_ptrs = group_ptrs  # i8* of each group's first record
        self.tok_ptrs = tok_ptrs  # (q i8*, dx f32*, sx f32*) of each token

    def load(self, base: ir.Value, offset: ir.Value, ty: ir.Type) -> ir.Value:
        return self.b.load(self.b.bitcast(self.b.gep(base, [offset]), ty.as_pointer()), align=1)

    def offset(self, start: ir.Value, add: int) -> ir.Value:
        return self.b.add(start, ir.Constant(start.type, add))

    def record(self, ptr: ir.Value, block: ir.Value) -> tuple[list, ir.Value, ir.Value | None, list | None]:
        """-> (4 unsigned code vectors, d per slot <8 x f32>, m <4 x f32> or None, Q8_0 signs or None)."""
        b = self.b
        start = b.mul(block, ir.Constant(block.type, RECORD_BYTES[self.kind]))
        prefetch = _declare(b, "llvm.prefetch.p0", ir.VoidType(), _I8.as_pointer(), _I32, _I32, _I32)
        # every cache line of the record (one prefetch per 136-byte Q8_0 record left the head's GEMV 1.6x
        # and its 16-token GEMM 1.2x slower), except in the Q4 GEMM: it passes over a record once per token
        # pair, and there one line a pass measured ~8% faster than two (80-byte records)
        one_line = len(self.tok_ptrs) > 1 and RECORD_BYTES[self.kind] < 128  # not Q8_0 or Q4_K
        lines = [0] if one_line else range(0, RECORD_BYTES[self.kind], 64)
        for line in lines:
            ahead = b.gep(ptr, [self.offset(start, PREFETCH_BYTES + line)])
            b.call(prefetch, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        d4 = b.fpext(self.load(ptr, self.offset(start, SCALES_AT[self.kind]), _V4xF16), _V4xF32)
        pairs = ir.Constant(ir.VectorType(_I32, 8), [0, 0, 1, 1, 2, 2, 3, 3])  # slot 2r + i: row r
        d8 = b.shuffle_vector(d4, d4, pairs)
        if self.kind in (KIND_Q4_K, KIND_Q5_K, KIND_Q6_K):  # 16 nibble vectors, then the high planes
            packed = [
                self.load(ptr, self.offset(start, at), _V32xI8) for at in k_quant_tile.VECTORS_AT[self.kind]
            ]
            if self.kind == KIND_Q6_K:
                return packed, lambda sub: k_quant_tile.q6_k_scales(self, ptr, start, sub, d4), None, None
            dmin4 = b.fpext(self.load(ptr, self.offset(start, SCALES_AT[self.kind] + 8), _V4xF16), _V4xF32)
            return packed, lambda sub: k_quant_tile.q4_k_scales(self, ptr, start, sub, d4, dmin4), None, None
        if self.kind == KIND_Q2_K:  # a packed vector per activation block; scales and mins per 16 values
            packed = [self.load(ptr, self.offset(start, 32 * p), _V32xI8) for p in range(8)]
            dmin4 = b.fpext(self.load(ptr, self.offset(start, SCALES_AT[self.kind] + 8), _V4xF16), _V4xF32)
            return packed, lambda sub: k_quant_tile.q2_k_scales(self, ptr, start, sub, d4, dmin4), None, None
        if self.kind in (KIND_Q2_0, KIND_Q1_0):
            packed = [self.load(ptr, self.offset(start, 32 * p), _V32xI8) for p in range(2)]
            if self.kind == KIND_Q1_0:  # (2c - 1) d: the code's scale is 2d, exact
                d8 = b.fadd(d8, d8)
            return packed, d8, b.fneg(d4), None  # packed: unpacked per block by block_codes
        if self.kind == KIND_Q8_0:
            values = [self.load(ptr, self.offset(start, 32 * j), _V32xI8) for j in range(CODE_VECTORS)]
            absolute = _declare(b, "llvm.abs.v32i8", _V32xI8, _V32xI8, ir.IntType(1))
            codes = [b.call(absolute, [v, ir.Constant(ir.IntType(1), 0)]) for v in values]
            return codes, d8, None, values  # u8 |w| (128 for -128), signs from w
        packed = [self.load(ptr, self.offset(start, 32 * p), _V32xI8) for p in range(2)]
        low = [b.and_(v, _splat(_V32xI8, 15)) for v in packed]
        high = [b.lshr(v, _splat(_V32xI8, 4)) for v in packed]
        codes = low + high
        if self.kind in (KIND_Q5_0, KIND_Q5_1):  # nibble vector j gains bit j of the high-bit vector as bit 4
            high_bits = self.load(ptr, self.offset(start, 2 * 32), _V32xI8)
            shifted = [b.shl(high_bits, _splat(_V32xI8, 4 - j)) for j in range(CODE_VECTORS)]
            codes = [b.or_(v, b.and_(h, _splat(_V32xI8, 16))) for v, h in zip(codes, shifted, strict=True)]
        if self.kind in (KIND_Q4_1, KIND_Q5_1):
            mins_at = self.offset(start, SCALES_AT[self.kind] + 2 * GROUP_ROWS)
            m4 = b.fpext(self.load(ptr, mins_at, _V4xF16), _V4xF32)
        else:  # Q4_0 / Q5_0: (code - c) d = code d + (-c d), exact in f32 (c = 8 or 16)
            offset = -8.0 if self.kind == KIND_Q4_0 else -16.0
            m4 = b.fmul(d4, ir.Constant(_V4xF32, [ir.Constant(_F32, offset)] * 4))
        return codes, d8, m4, None

    def block_codes(self, vectors: list, sub: int, signs: list | None) -> tuple[list, list | None]:
        """(the CODE_VECTORS u8 code vectors, their signs or None) of activation block `sub` of a record
        (record()'s vectors and signs)."""
        if self.kind in (KIND_Q2_0, KIND_Q2_K):
            return [self.field(vectors[sub], 2 * j, 3) for j in range(CODE_VECTORS)], None
        if self.kind == KIND_Q1_0:
            return [self.field(vectors[sub // 2], 4 * (sub % 2) + j, 1) for j in range(CODE_VECTORS)], None
        if self.kind == KIND_Q4_K:
            return k_quant_tile.q4_k_codes(self, vectors, sub), None
        if self.kind == KIND_Q5_K:
            return k_quant_tile.q5_k_codes(self, vectors, sub), None
        if self.kind == KIND_Q6_K:
            return k_quant_tile.q6_k_codes(self, vectors, sub)
        return vectors, signs

    def field(self, packed: ir.Value, shift: int, mask: int) -> ir.Value:
        """(packed >> shift) & mask in every byte."""
        b = self.b
        shifted = b.lshr(packed, _splat(_V32xI8, shift)) if shift else packed
        return b.and_(shifted, _splat(_V32xI8, mask))

    def integer_dot(self, codes: ir.Value, acts: ir.Value) -> ir.Value:
        """u8 codes x s8 acts -> <8 x i32> sums of 4 products each (exact)."""
        b = self.b
        if self.isa == _VNNI:
            dpbusd = _declare(b, "llvm.x86.avx512.vpdpbusd.256", _V8xI32, _V8xI32, _V8xI32, _V8xI32)
            return b.call(dpbusd, [_splat(_V8xI32, 0), b.bitcast(codes, _V8xI32), b.bitcast(acts, _V8xI32)])
        maddubs = _declare(b, "llvm.x86.avx2.pmadd.ub.sw", _V16xI16, _V32xI8, _V32xI8)
        maddwd = _declare(b, "llvm.x86.avx2.pmadd.wd", _V8xI32, _V16xI16, _V16xI16)
        return b.call(maddwd, [b.call(maddubs, [codes, acts]), _splat(_V16xI16, 1)])

    def token_acts(self, q_ptr: ir.Value, block: ir.Value) -> list[ir.Value]:
        """The 4 activation runs of a token's block, each 8 bytes broadcast to every row's slot."""
        b = self.b
        start = b.mul(block, ir.Constant(block.type, QK))
        runs = []
        for j in range(CODE_VECTORS):
            run = self.load(q_ptr, self.offset(start, 8 * j), _I64)
            first = b.insert_element(ir.Constant(_V4xI64, ir.Undefined), run, ir.Constant(_I32, 0))
            spread = b.shuffle_vector(first, first, ir.Constant(ir.VectorType(_I32, 4), [0] * 4))
            runs.append(b.bitcast(spread, _V32xI8))
        return runs

    def emit(self, num_blocks: ir.Value) -> list[ir.Value]:
        """-> f32 per (row, token), rows of all groups in order, token-minor."""
        b = self.b
        num_toks = len(self.tok_ptrs)
        min_type = ir.VectorType(_F32, GROUP_ROWS * num_toks)  # lane t * 4 + r: row r, token t
        zero8 = ir.Constant(_V8xF32, [ir.Constant(_F32, 0.0)] * 8)
        zero_mins = ir.Constant(min_type, [ir.Constant(_F32, 0.0)] * min_type.count)
        accs = {
            (g, t, j): cgutils.alloca_once_value(b, zero8)
            for g in range(len(self.group_ptrs))
            for t in range(num_toks)
            for j in range(CODE_VECTORS)
        }
        mins = [cgutils.alloca_once_value(b, zero_mins) for _ in self.group_ptrs]
        per_record = ir.Constant(num_blocks.type, BLOCKS_PER_RECORD[self.kind])
        with cgutils.for_range(b, b.udiv(num_blocks, per_record)) as loop:
            records = [self.record(ptr, loop.index) for ptr in self.group_ptrs]
            first_block = b.mul(loop.index, per_record)
            for sub in range(BLOCKS_PER_RECORD[self.kind]):
                block = b.add(first_block, ir.Constant(num_blocks.type, sub))
                self.block_step(block, sub, records, accs, mins)
        return self.epilogue(accs, mins, num_toks)

    def block_step(self, block: ir.Value, sub: int, records: list, accs: dict, mins: list) -> None:
        """Activation block `block` (block `sub` of each record): its FMAs into accs, its min term (sum of
        m * sx) into mins."""
        b = self.b
        num_toks = len(self.tok_ptrs)
        min_type = mins[0].type.pointee
        fma = _declare(b, "llvm.fma.v8f32", _V8xF32, _V8xF32, _V8xF32, _V8xF32)
        fma_mins = _declare(b, f"llvm.fma.v{min_type.count}f32", min_type, min_type, min_type, min_type)
        psign = _declare(b, "llvm.x86.avx2.psign.b", _V32xI8, _V32xI8, _V32xI8)  # vpsignb
        toks = []
        sx_lanes = ir.Constant(min_type, [ir.Constant(_F32, 0.0)] * min_type.count)
        for t, (q_ptr, dx_ptr, sx_ptr) in enumerate(self.tok_ptrs):
            dx = b.load(b.gep(dx_ptr, [block]))
            acts = self.token_acts(q_ptr, block)
            # Q2_K's min is per 16 values: it meets the activations' lane sums (a dot with ones, exact)
            sums = None
            if self.kind == KIND_Q2_K:
                sums = [b.sitofp(self.integer_dot(_splat(_V32xI8, 1), a), _V8xF32) for a in acts]
            toks.append((acts, _splat_value(b, dx, _V8xF32), sums))
            if self.kind not in (KIND_Q8_0, KIND_Q6_K, KIND_Q2_K):  # kinds with a min term per 32 values
                sx = b.load(b.gep(sx_ptr, [block]))
                for r in range(GROUP_ROWS):
                    sx_lanes = b.insert_element(sx_lanes, sx, ir.Constant(_I32, t * GROUP_ROWS + r))
        for g, (vectors, d8, m4, signs) in enumerate(records):
            if callable(d8):  # K-quants: scales per sub-block
                d8, m4 = d8(sub)
            per_vector = d8 if isinstance(d8, list) else [d8, d8]  # Q6_K, Q2_K: a scale per 16 values
            half_mins, m4 = (m4, None) if isinstance(m4, list) else (None, m4)  # Q2_K: -(dmin m) per 16
            codes, signs = self.block_codes(vectors, sub, signs)
            for t, (acts, dx8, sums) in enumerate(toks):
                scales = [b.fmul(d, dx8) for d in per_vector]  # d * dx of each slot's row, per lane
                for j in range(CODE_VECTORS):
                    a = acts[j]
                    if signs is not None:  # Q8_0: |w| * (q with w's sign); w = 0 gives 0 either way
                        a = b.call(psign, [a, signs[j]])
                    lanes = b.sitofp(self.integer_dot(codes[j], a), _V8xF32)
                    slot = accs[(g, t, j)]
                    acc = b.call(fma, [scales[j // 2], lanes, b.load(slot)])
                    if half_mins is not None:
                        acc = b.call(fma, [b.fmul(half_mins[j // 2], dx8), sums[j], acc])
                    b.store(acc, slot)
            if m4 is not None:
                rows_again = list(range(GROUP_ROWS)) * num_toks
                repeat = ir.Constant(ir.VectorType(_I32, min_type.count), rows_again)
                m_lanes = b.shuffle_vector(m4, m4, repeat)
                b.store(b.call(fma_mins, [m_lanes, sx_lanes, b.load(mins[g])]), mins[g])

    def epilogue(self, accs: dict, mins: list, num_toks: int) -> list[ir.Value]:
        """Lane sums in hsum_float_8's order ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), plus the min term.
        Vector j holds lanes 2j, 2j + 1 of each row, so (j0 + j2) + (j1 + j3) makes that order per slot
        pair, and slot 2r + slot 2r + 1 the final sum."""
        b = self.b
        sums = []
        for g in range(len(self.group_ptrs)):
            row_mins = b.load(mins[g])
            for r in range(GROUP_ROWS):
                for t in range(num_toks):
                    sums.append((g, r, t))
            per_token = []
            for t in range(num_toks):
                acc = [b.load(accs[(g, t, j)]) for j in range(CODE_VECTORS)]
                per_token.append(b.fadd(b.fadd(acc[0], acc[2]), b.fadd(acc[1], acc[3])))
            for r in range(GROUP_ROWS):
                for t in range(num_toks):
                    pair = [b.extract_element(per_token[t], ir.Constant(_I32, 2 * r + i)) for i in range(2)]
                    minimum = b.extract_element(row_mins, ir.Constant(_I32, t * GROUP_ROWS + r))
                    sums[g * GROUP_ROWS * num_toks + r * num_toks + t] = b.fadd(b.fadd(*pair), minimum)
        return sums


def _splat_value(b: ir.IRBuilder, value: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    """A scalar in every lane of vector_type."""
    first = b.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count)
    return b.shuffle_vector(first, first, zeros)


def _is_records(ty: types.Type) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == types.uint8 and ty.ndim == 3 and ty.layout == "C"


@intrinsic
def _interleaved_tile(
    typingctx: object,
    isa: types.Type,
    kind: types.Type,
    groups: types.Type,
    toks: types.Type,
    w: types.Type,
    w_group: types.Type,
    q: types.Type,
    dx: types.Type,
    sx: types.Type,
    q_row: types.Type,
) -> tuple | None:
    """_interleaved_tile(isa, kind, groups, toks, w, w_group, q, dx, sx, q_row) -> UniTuple(float32, n).

    isa, kind, groups, toks: integer literals. w uint8 [G, nb, record] (repack), q int8 [Tp, K], dx / sx
    f32 [Tp, nb], all C order. n = groups * 4 * toks; entry (g * 4 + r) * toks + t is row
    4 (w_group + g) + r, token q_row + t.
    """
    literals = (isa, kind, groups, toks)
    if not all(isinstance(v, types.IntegerLiteral) for v in literals):
        return None
    if not (_is_records(w) and _is_c_matrix(q, types.int8)):
        return None
    if not (_is_c_matrix(dx, types.float32) and _is_c_matrix(sx, types.float32)):
        return None
    isa_code, kind_code, num_groups, num_toks = (v.literal_value for v in literals)
    sig = types.UniTuple(types.float32, num_groups * GROUP_ROWS * num_toks)(
        isa, kind, groups, toks, w, w_group, q, dx, sx, q_row
    )

    def codegen(context: object, builder: ir.IRBuilder, signature: object, llargs: tuple) -> ir.Value:
        w_val, w_group_val, q_val, dx_val, sx_val, q_row_val = llargs[4:]
        w_arr = context.make_array(w)(context, builder, w_val)
        q_arr = context.make_array(q)(context, builder, q_val)
        dx_arr = context.make_array(dx)(context, builder, dx_val)
        sx_arr = context.make_array(sx)(context, builder, sx_val)
        group_stride = builder.extract_value(w_arr.strides, 0)  # bytes per group of 4 rows
        q_stride = builder.extract_value(q_arr.strides, 0)
        num_blocks = builder.extract_value(dx_arr.shape, 1)
        group_ptrs = [
            builder.gep(
                w_arr.data,
                [builder.mul(builder.add(w_group_val, ir.Constant(w_group_val.type, g)), group_stride)],
            )
            for g in range(num_groups)
        ]
        tok_ptrs = []
        for t in range(num_toks):
            tok = builder.add(q_row_val, ir.Constant(q_row_val.type, t))
            q_ptr = builder.gep(q_arr.data, [builder.mul(tok, q_stride)])
            dx_ptr = builder.gep(dx_arr.data, [builder.mul(tok, num_blocks)])
            sx_ptr = builder.gep(sx_arr.data, [builder.mul(tok, num_blocks)])
            tok_ptrs.append((q_ptr, dx_ptr, sx_ptr))
        emitter = _InterleavedTileEmitter(builder, kind_code, isa_code, group_ptrs, tok_ptrs)
        sums = emitter.emit(num_blocks)
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


# ---------------------------------------------------------------- kernels


@njit(parallel=True, nogil=True, cache=True)
def _interleaved_body(
    isa: int,
    kind: int,
    groups: int,
    toks: int,
    w: np.ndarray,
    q: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    out: np.ndarray,
) -> None:
    """w uint8 [G, nb, record] (repack), q int8 [Tp, K], dx / sx f32 [Tp, nb] -> out f32 [T, M], M <= 4 G.
    Per task, TOKEN_BLOCK tokens at a time over the task's rows: each weight byte comes from memory once
    per step (the task's records stay in L1/L2 across token blocks)."""
    literally(isa)
    literally(kind)
    literally(groups)
    literally(toks)
    num_groups = w.shape[0]
    task_groups = ROWS_PER_TASK // GROUP_ROWS
    for task in prange((num_groups + task_groups - 1) // task_groups):
        g_start = task * task_groups
        g_end = min(num_groups, g_start + task_groups)
        full_end = g_start + (g_end - g_start) // groups * groups
        for t_block in range(0, q.shape[0], TOKEN_BLOCK):
            t_end = min(q.shape[0], t_block + TOKEN_BLOCK)
            for g in range(g_start, full_end, groups):
                for t0 in range(t_block, t_end, toks):
                    y = _interleaved_tile(isa, kind, groups, toks, w, g, q, dx, sx, t0)
                    _store(y, groups * GROUP_ROWS, toks, g * GROUP_ROWS, t0, out)
            for g in range(full_end, g_end):
                for t0 in range(t_block, t_end, toks):
                    y1 = _interleaved_tile(isa, kind, 1, toks, w, g, q, dx, sx, t0)
                    _store(y1, GROUP_ROWS, toks, g * GROUP_ROWS, t0, out)


@njit(nogil=True, cache=True, inline="always")
def _store(y: tuple, rows: int, toks: int, r0: int, t0: int, out: np.ndarray) -> None:
    for t in range(t0, min(t0 + toks, out.shape[0])):
        for i in range(min(rows, out.shape[1] - r0)):
            out[t, r0 + i] = y[i * toks + t - t0]
