"""The K-quant parts of the interleaved int8 tile's IR (kernels/cpu/interleaved._InterleavedTileEmitter):
per-sub-block scales and code vectors of the Q4_K, Q5_K, Q6_K and Q2_K records (layouts: k_quant_records.py).

Both records span one 256-value super-block of 4 rows, 8 activation blocks of 32 values; `sub` below is
the activation block. Every scale product is exact in f32 (an f16 times a 6- or 8-bit integer), so the
weights the tile multiplies are the reference decoder's values.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from bitserve.kernels.cpu.int8_tile import _declare

Q4_K_SCALES_AT, Q4_K_MINS_AT = 512, 544  # sub-block s's 6-bit scales of the 4 rows at + 4 s, mins likewise
Q5_K_HIGH_AT = 592  # Q5_K: a Q4_K record, then 4 high-bit planes (plane g: sub-blocks 2g, 2g + 1)
Q6_K_HIGH_AT, Q6_K_SCALES_AT = 512, 768  # the 2-bit high planes; 16-value sub-block t's int8 scales at + 4 t
Q2_K_SCALES_AT = 256  # 16-value sub-block t's 4 bytes (scale | min << 4, as in the file) at + 4 t
# the byte offset of each 32-byte vector a record() loads, by kind (Q4_K 8, Q6_K 9, Q5_K 10)
_NIBBLES = tuple(32 * p for p in range(16))
VECTORS_AT = {
    8: _NIBBLES,
    9: (*_NIBBLES, *(Q6_K_HIGH_AT + 32 * b for b in range(8))),
    10: (*_NIBBLES, *(Q5_K_HIGH_AT + 32 * g for g in range(4))),
}
_I8, _I32, _F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
_V4xI8, _V4xF32, _V32xI8 = ir.VectorType(_I8, 4), ir.VectorType(_F32, 4), ir.VectorType(_I8, 32)
_SLOT_PAIRS = ir.Constant(ir.VectorType(_I32, 8), [0, 0, 1, 1, 2, 2, 3, 3])  # slot 2r + i: row r


def _per_slot(b: ir.IRBuilder, four: ir.Value) -> ir.Value:
    return b.shuffle_vector(four, four, _SLOT_PAIRS)


def q4_k_scales(e: Any, ptr: ir.Value, start: ir.Value, sub: int, d4: ir.Value, dmin4: ir.Value) -> tuple:
    """Q4_K: (d sc per slot <8 x f32>, -(dmin m) <4 x f32>) of sub-block `sub`."""
    b = e.b
    sc = b.uitofp(e.load(ptr, e.offset(start, Q4_K_SCALES_AT + 4 * sub), _V4xI8), _V4xF32)
    mn = b.uitofp(e.load(ptr, e.offset(start, Q4_K_MINS_AT + 4 * sub), _V4xI8), _V4xF32)
    return _per_slot(b, b.fmul(d4, sc)), b.fneg(b.fmul(dmin4, mn))


def q4_k_codes(e: Any, vectors: list, sub: int) -> list:
    """Q4_K sub-block 2g + h: nibble h of the 4 vectors of pair g."""
    return [e.field(vectors[4 * (sub // 2) + j], 4 * (sub % 2), 15) for j in range(4)]


def q5_k_codes(e: Any, vectors: list, sub: int) -> list:
    """Q5_K sub-block 2g + h: Q4_K's nibbles plus bit 4 h + j of high plane g (vector 16 + g) as bit 4:
    codes 0..31."""
    b = e.b
    four = ir.Constant(_V32xI8, [ir.Constant(_I8, 4)] * 32)
    highs = [b.shl(e.field(vectors[16 + sub // 2], 4 * (sub % 2) + j, 1), four) for j in range(4)]
    return [b.or_(low, high) for low, high in zip(q4_k_codes(e, vectors, sub), highs, strict=True)]


def q6_k_scales(e: Any, ptr: ir.Value, start: ir.Value, sub: int, d4: ir.Value) -> tuple:
    """Q6_K: [d sc per slot of the block's first 16 values, of its last 16] and no min (signed codes)."""
    b = e.b
    scales = []
    for half in range(2):
        at = e.offset(start, Q6_K_SCALES_AT + 4 * (2 * sub + half))
        scales.append(_per_slot(b, b.fmul(d4, b.sitofp(e.load(ptr, at, _V4xI8), _V4xF32))))
    return scales, None


def q6_k_codes(e: Any, vectors: list, sub: int) -> tuple[list, list]:
    """Q6_K block `sub`: (|code - 32| as u8, code - 32 as the signs) per code vector j: the low nibble
    from the 16 nibble vectors as Q4_K's, the top 2 bits from high plane `sub` at bits 2j."""
    b = e.b
    absolute = _declare(b, "llvm.abs.v32i8", _V32xI8, _V32xI8, ir.IntType(1))
    signed = []
    for j in range(4):
        low = e.field(vectors[4 * (sub // 2) + j], 4 * (sub % 2), 15)
        high = b.shl(e.field(vectors[16 + sub], 2 * j, 3), ir.Constant(_V32xI8, [ir.Constant(_I8, 4)] * 32))
        signed.append(b.sub(b.or_(low, high), ir.Constant(_V32xI8, [ir.Constant(_I8, 32)] * 32)))
    return [b.call(absolute, [w, ir.Constant(ir.IntType(1), 0)]) for w in signed], signed


def q2_k_scales(e: Any, ptr: ir.Value, start: ir.Value, sub: int, d4: ir.Value, dmin4: ir.Value) -> tuple:
    """Q2_K: ([d sc per slot] of the block's first 16 values, of its last 16; [-(dmin m) per slot] the
    same), each <8 x f32>."""
    b = e.b
    low, shift = (ir.Constant(_V4xI8, [ir.Constant(_I8, v)] * 4) for v in (15, 4))
    scales, mins = [], []
    for half in range(2):
        packed = e.load(ptr, e.offset(start, Q2_K_SCALES_AT + 4 * (2 * sub + half)), _V4xI8)
        sc, mn = b.uitofp(b.and_(packed, low), _V4xF32), b.uitofp(b.lshr(packed, shift), _V4xF32)
        scales.append(_per_slot(b, b.fmul(d4, sc)))
        mins.append(_per_slot(b, b.fneg(b.fmul(dmin4, mn))))
    return scales, mins
