"""The int8 tile of the ternary kernels (kernels/cpu/int8dot.py): `_tile`, an `@intrinsic` that writes one
tile's loop in LLVM IR with the x86 integer-dot intrinsics (numba's auto-vectorizer never emits them).

A tile is `rows` weight rows x `toks` tokens of int32 sums of code * q over a range of 128-column groups:
each row's codes are loaded and unpacked once per group (shared by all the tile's tokens) and each
token's activations once per group (shared by all its rows). Layout: int8dot's docstring. Also the IR
helpers the other int8 tiles build on (kernels/cpu/interleaved.py, k_quant_tile.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from bitserve.kernels.cpu.isa import Isa
from bitserve.kernels.cpu.ternary import GROUP_BYTES, GROUP_COLS, PLANES

PLANE_BYTES = GROUP_COLS // PLANES  # 32 codes / activations per plane: one 256-bit vector
# int16 lanes hold the sum of FLUSH_GROUPS groups: per group a lane gets 4 planes x 2 products of code (<= 2)
# times q (in [-128, 127]), so |sum| <= 16 * 8 * 256 = 32768, and the extremes are -32768 (all codes 2,
# all q -128) and 16 * 8 * 254 = 32512: both fit int16. vpaddw wraps, but the wrapped sum of terms
# whose true total fits is that total, so only the total at the flush has to fit.
FLUSH_GROUPS = 16
PREFETCH_TILES = 2  # software prefetch distance in row tiles (RESULTS.md "Ternary GEMV at 2 threads")
CACHE_LINE = 64
PREFETCH_BYTES = 12288  # the Q4 / Q8_0 tiles' software prefetch distance (kernels/cpu/interleaved.py)
ISA_CODES = {Isa.AVX2: 1, Isa.VNNI: 2}  # the `isa` literal the kernels take
_AVX2, _VNNI = ISA_CODES[Isa.AVX2], ISA_CODES[Isa.VNNI]

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32xI8 = ir.VectorType(_I8, 32)
_V16xI16 = ir.VectorType(_I16, 16)
_V8xI32 = ir.VectorType(_I32, 8)


def _splat(vector_type: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(vector_type, [ir.Constant(vector_type.element, value)] * vector_type.count)


def _declare(builder: ir.IRBuilder, name: str, ret: ir.Type, *args: ir.Type) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(args)), name)


class _TileEmitter:
    """Writes the IR of one tile: rows x toks int32 sums of code * q over a range of groups."""

    def __init__(self, builder: ir.IRBuilder, row_ptrs: list, tok_ptrs: list, ahead: ir.Value) -> None:
        self.b = builder
        self.row_ptrs = row_ptrs  # i8* of each row's first group
        self.tok_ptrs = tok_ptrs  # i8* of each token's first group
        self.ahead = ahead  # i8* of the first row of the tile PREFETCH_TILES ahead: prefetched as we go

    def load(self, base: ir.Value, offset: ir.Value) -> ir.Value:
        """An unaligned 32-byte load at base + offset."""
        ptr = self.b.bitcast(self.b.gep(base, [offset]), _V32xI8.as_pointer())
        return self.b.load(ptr, align=1)

    def group_operands(self, g: ir.Value) -> tuple[list[list[ir.Value]], list[list[ir.Value]]]:
        """Group g -> (planes[row][s] code vectors, acts[tok][s] activation vectors)."""
        b = self.b
        planes = []
        self.prefetch_ahead(g)
        offset = b.mul(g, ir.Constant(g.type, GROUP_BYTES))
        for ptr in self.row_ptrs:
            codes = self.load(ptr, offset)  # [32] u8, 4 fields each
            three = _splat(_V32xI8, 3)
            shifts = [_splat(_V32xI8, 6 - 2 * s) for s in range(PLANES)]  # I2_S: plane 0 in the high bits
            planes.append([b.and_(b.lshr(codes, shift), three) for shift in shifts])
        acts = []
        for ptr in self.tok_ptrs:
            base = b.mul(g, ir.Constant(g.type, GROUP_COLS))
            offsets = [b.add(base, ir.Constant(g.type, PLANE_BYTES * s)) for s in range(PLANES)]
            acts.append([self.load(ptr, offset) for offset in offsets])
        return planes, acts

    def prefetch_ahead(self, g: ir.Value) -> None:
        """Prefetch the next rows x 32 bytes of the tile PREFETCH_TILES ahead, as one sequential stream from
        its first row: over this tile's groups that covers that tile's rows, which lie one after another
        within a weight (where a stacked group's weights meet, a tile's worth of prefetches may miss).

        Why one stream: prefetching 12 KB past each of the tile's row pointers (8 interleaved streams a
        row apart, each line requested twice) read cold weights at 54-82% of numpy's read bandwidth on one
        thread; this reads at 75-106% (benchmarks/RESULTS.md "Ternary GEMV at 2 threads").
        """
        b = self.b
        prefetch = _declare(b, "llvm.prefetch.p0", ir.VoidType(), _I8.as_pointer(), _I32, _I32, _I32)
        step = GROUP_BYTES * len(self.row_ptrs)
        start = b.gep(self.ahead, [b.mul(g, ir.Constant(g.type, step))])
        for line in range(max(1, step // CACHE_LINE)):
            # read, all cache levels, data; x86 prefetches never fault, so past the end is harmless
            address = b.gep(start, [ir.Constant(g.type, line * CACHE_LINE)])
            b.call(prefetch, [address, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])

    def pairs(self) -> list[tuple[int, int]]:
        return [(r, t) for r in range(len(self.row_ptrs)) for t in range(len(self.tok_ptrs))]

    def emit_avx2(self, g0: ir.Value, num_groups: ir.Value) -> list[ir.Value]:
        """vpmaddubsw into int16 sums, widened every FLUSH_GROUPS groups. -> <8 x i32> per pair."""
        b = self.b
        maddubs = _declare(b, "llvm.x86.avx2.pmadd.ub.sw", _V16xI16, _V32xI8, _V32xI8)
        maddwd = _declare(b, "llvm.x86.avx2.pmadd.wd", _V8xI32, _V16xI16, _V16xI16)
        acc32 = [cgutils.alloca_once_value(b, _splat(_V8xI32, 0)) for _ in self.pairs()]
        acc16 = [cgutils.alloca_once(b, _V16xI16) for _ in self.pairs()]
        flush = ir.Constant(num_groups.type, FLUSH_GROUPS)
        num_chunks = b.udiv(b.add(num_groups, ir.Constant(num_groups.type, FLUSH_GROUPS - 1)), flush)
        with cgutils.for_range(b, num_chunks) as chunk:
            start = b.mul(chunk.index, flush)
            left = b.sub(num_groups, start)
            count = b.select(b.icmp_signed("<", left, flush), left, flush)
            for slot in acc16:
                b.store(_splat(_V16xI16, 0), slot)
            with cgutils.for_range(b, count) as step:
                planes, acts = self.group_operands(b.add(g0, b.add(start, step.index)))
                for slot, (r, t) in zip(acc16, self.pairs(), strict=True):
                    m = [b.call(maddubs, [planes[r][s], acts[t][s]]) for s in range(PLANES)]
                    b.store(b.add(b.load(slot), b.add(b.add(m[0], m[1]), b.add(m[2], m[3]))), slot)
            for slot32, slot16 in zip(acc32, acc16, strict=True):
                widened = b.call(maddwd, [b.load(slot16), _splat(_V16xI16, 1)])
                b.store(b.add(b.load(slot32), widened), slot32)
        return [b.load(slot) for slot in acc32]

    def emit_vnni(self, g0: ir.Value, num_groups: ir.Value) -> list[ir.Value]:
        """vpdpbusd straight into int32 lanes. -> <8 x i32> per pair. Small tiles get two accumulators per
        pair (planes 0-1, 2-3) to halve the dependency chain; large ones have enough chains already (and
        AVX-VNNI has only 16 vector registers)."""
        b = self.b
        dpbusd = _declare(b, "llvm.x86.avx512.vpdpbusd.256", _V8xI32, _V8xI32, _V8xI32, _V8xI32)
        per_pair = 2 if len(self.pairs()) <= 4 else 1
        accs = [
            [cgutils.alloca_once_value(b, _splat(_V8xI32, 0)) for _ in range(per_pair)] for _ in self.pairs()
        ]
        with cgutils.for_range(b, num_groups) as step:
            planes, acts = self.group_operands(b.add(g0, step.index))
            for slots, (r, t) in zip(accs, self.pairs(), strict=True):
                for s in range(PLANES):
                    slot = slots[s * len(slots) // PLANES]
                    codes = b.bitcast(planes[r][s], _V8xI32)
                    act = b.bitcast(acts[t][s], _V8xI32)
                    b.store(b.call(dpbusd, [b.load(slot), codes, act]), slot)
        return [
            b.add(b.load(slots[0]), b.load(slots[-1])) if len(slots) > 1 else b.load(slots[0])
            for slots in accs
        ]


def _is_c_matrix(ty: types.Type, dtype: types.Type) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == dtype and ty.ndim == 2 and ty.layout == "C"


def _is_c_vector(ty: types.Type, dtype: types.Type) -> bool:
    return isinstance(ty, types.Array) and ty.dtype == dtype and ty.ndim == 1 and ty.layout == "C"


def _hsum(builder: ir.IRBuilder, vector: ir.Value) -> ir.Value:
    total = builder.extract_element(vector, ir.Constant(_I32, 0))
    for lane in range(1, vector.type.count):
        total = builder.add(total, builder.extract_element(vector, ir.Constant(_I32, lane)))
    return total


@intrinsic
def _tile(
    typingctx: object,
    isa: types.Type,
    rows: types.Type,
    toks: types.Type,
    w: types.Type,
    row_off: types.Type,
    w_row: types.Type,
    q: types.Type,
    q_row: types.Type,
    g0: types.Type,
    num_groups: types.Type,
) -> tuple | None:
    """_tile(isa, rows, toks, w, row_off, w_row, q, q_row, g0, num_groups) -> UniTuple(int32, rows * toks).

    isa, rows, toks: integer literals. w uint8 [n] holds the rows, row r's codes at byte row_off[r]
    (int64 [M]); q int8 [Tp, Kp], C order. Entry r * toks + t is sum(code * q) of row w_row + r and token
    q_row + t over groups g0 .. g0 + num_groups - 1.
    """
    literals = (isa, rows, toks)
    if not all(isinstance(v, types.IntegerLiteral) for v in literals):
        return None  # numba retries with the literal types
    if not (_is_c_vector(w, types.uint8) and _is_c_vector(row_off, types.int64)):
        return None
    if not _is_c_matrix(q, types.int8):
        return None
    isa_code, num_rows, num_toks = (v.literal_value for v in literals)
    sig = types.UniTuple(types.int32, num_rows * num_toks)(
        isa, rows, toks, w, row_off, w_row, q, q_row, g0, num_groups
    )

    def codegen(context: object, builder: ir.IRBuilder, signature: object, llargs: tuple) -> ir.Value:
        w_val, row_off_val, w_row_val, q_val, q_row_val, g0_val, num_groups_val = llargs[3:]
        w_arr = context.make_array(w)(context, builder, w_val)
        off_arr = context.make_array(row_off)(context, builder, row_off_val)
        q_arr = context.make_array(q)(context, builder, q_val)
        q_stride = builder.extract_value(q_arr.strides, 0)  # bytes per token
        q_base = builder.gep(q_arr.data, [builder.mul(q_row_val, q_stride)])
        first_off = builder.gep(off_arr.data, [w_row_val])
        row_ptrs = [
            builder.gep(w_arr.data, [builder.load(builder.gep(first_off, [ir.Constant(w_row_val.type, r)]))])
            for r in range(num_rows)
        ]
        tok_ptrs = [
            builder.gep(q_base, [builder.mul(q_stride, ir.Constant(q_stride.type, t))])
            for t in range(num_toks)
        ]
        # a GEMV streams its weights once, from DRAM: the hardware prefetchers alone left it at ~40% of
        # the read bandwidth. The tile PREFETCH_TILES ahead is found through the row table (so a stacked
        # group's next weight is found too), clamped to the last row (past it: harmless prefetches)
        last_row = builder.sub(builder.extract_value(off_arr.shape, 0), ir.Constant(w_row_val.type, 1))
        ahead_row = builder.add(w_row_val, ir.Constant(w_row_val.type, PREFETCH_TILES * num_rows))
        ahead_row = builder.select(builder.icmp_signed(">", ahead_row, last_row), last_row, ahead_row)
        ahead = builder.gep(w_arr.data, [builder.load(builder.gep(off_arr.data, [ahead_row]))])
        emitter = _TileEmitter(builder, row_ptrs, tok_ptrs, ahead)
        emit = emitter.emit_vnni if isa_code == _VNNI else emitter.emit_avx2
        sums = emit(g0_val, num_groups_val)
        return context.make_tuple(builder, signature.return_type, [_hsum(builder, v) for v in sums])

    return sig, codegen
