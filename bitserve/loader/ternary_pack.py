"""Independent producers of bitnet.cpp's ternary file layouts (I2_S, TL1, TL2), in plain numpy.

Each follows the structure of the code that writes real files (docs/formats.md §2.2-2.3; quantize_i2_s in
ggml-bitnet-mad.cpp, preprocess_weights_tl1/tl2 in convert-hf-to-gguf-bitnet.py), not the inverse of
bitserve's decoder, so tests that pack here and decode with `kernels.reference.dequant` check the two
against each other. Used by tests, the GGUF test writer and benchmarks.
"""

from __future__ import annotations

import numpy as np

from bitserve.kernels.reference.dequant import (
    SCALE_SLOT_BYTES,
    i2s_geometry_error,
    tl2_stored_bytes,
    tl2_used_bytes,
    tl_geometry_error,
)
from bitserve.loader.tl_config import TileConfig

_TL2_ROW_GROUP_PERM = [0, 2, 1, 3]


def _scale_slot(scale: float) -> bytes:
    """The hidden 32-byte slot: f32 scale first, zeros after (HF converter / gguf writer padding)."""
    return np.float32(scale).astype("<f4").tobytes() + bytes(SCALE_SLOT_BYTES - 4)


def _as_ternary(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim != 2:
        raise ValueError(f"expected a 2-D [M, K] matrix, got shape {values.shape}")
    if not np.isin(values, (-1, 0, 1)).all():
        raise ValueError("values must be ternary (-1, 0, +1)")
    return values.astype(np.int16)


# ------------------------------------------------------------------------------------------------ I2_S
def quantize_i2s(weights: np.ndarray, variant: str = "A") -> bytes:
    """float [M, K] (ternary x one scale) -> I2_S bytes: M*K/4 packed codes, then the 32-byte scale slot.

    scale = max|w| over the whole tensor (in double, stored f32); code 1 for |w| < 1e-6, 2 for w > 0, else 0.
    """
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D [M, K] matrix, got shape {w.shape}")
    num_rows, num_cols = w.shape
    problem = i2s_geometry_error(variant, num_rows, num_cols)
    if problem:
        raise ValueError(problem)
    wide = w.astype(np.float64).reshape(-1)
    scale = float(np.max(np.abs(wide))) if wide.size else 0.0
    q8 = np.where(np.abs(wide) < 1e-6, 1, np.where(wide * scale > 0, 2, 0)).astype(np.uint8)
    return _i2s_bytes(q8, num_rows, num_cols, variant) + _scale_slot(scale)


def i2s_from_codes(codes: np.ndarray, scale: float, variant: str = "A") -> bytes:
    """int8 codes [M, K] in {-1, 0, +1} and the value of code 1 -> I2_S bytes (the bytes quantize_i2s
    writes for codes * scale)."""
    num_rows, num_cols = codes.shape
    problem = i2s_geometry_error(variant, num_rows, num_cols)
    if problem:
        raise ValueError(problem)
    q8 = (np.asarray(codes, dtype=np.int8).reshape(-1) + 1).astype(np.uint8)
    return _i2s_bytes(q8, num_rows, num_cols, variant) + _scale_slot(scale)


def _i2s_bytes(q8: np.ndarray, num_rows: int, num_cols: int, variant: str) -> bytes:
    """Codes + 1, uint8 [M * K] row-major -> the packed I2_S code bytes of `variant`."""
    if variant == "C":
        # one byte per column for each group of 4 rows: rows 4g..4g+3 at shifts 6, 4, 2, 0
        rows = q8.reshape(num_rows // 4, 4, num_cols)
        packed = rows[:, 0] << 6 | rows[:, 1] << 4 | rows[:, 2] << 2 | rows[:, 3]
    else:
        # QK values per block; value j goes to byte (j % group) of its block at shift 6 - 2*(j // group)
        qk, group = (128, 32) if variant == "A" else (64, 16)
        blocks = q8.reshape(-1, qk)
        packed = np.zeros((blocks.shape[0], group), dtype=np.uint8)
        for group_idx in range(4):
            packed |= blocks[:, group_idx * group : (group_idx + 1) * group] << (6 - 2 * group_idx)
    return packed.astype(np.uint8).tobytes()


def tq2_0_from_codes(codes: np.ndarray, scale: float) -> bytes:
    """int8 codes [M, K] (K a multiple of 256) and the value of code 1 -> TQ2_0 blocks, the bytes ggml's
    quantize_row_tq2_0_ref writes for codes * scale: per 256 values, 64 bytes of codes + 1 (qs[32h + m]
    holds value 128h + 32l + m at bits 2l) and d = f16(scale), or 0 for a block of zeros (amax 0)."""
    num_rows, num_cols = codes.shape
    if num_cols % 256:
        raise ValueError(f"TQ2_0 needs rows of whole 256-value blocks, got {num_cols} values")
    blocks = (np.asarray(codes, dtype=np.int8).reshape(-1, 2, 4, 32) + 1).astype(np.uint8)  # [N, h, l, m]
    qs = blocks[:, :, 0] | blocks[:, :, 1] << 2 | blocks[:, :, 2] << 4 | blocks[:, :, 3] << 6  # [N, h, m]
    nonzero = (blocks != 1).reshape(-1, 256).any(axis=1)
    d = np.where(nonzero, np.float16(scale), np.float16(0)).astype(np.float16)
    return np.concatenate([qs.reshape(-1, 64), d.reshape(-1, 1).view(np.uint8)], axis=1).tobytes()


# ------------------------------------------------------------------------------------------ TL1 / TL2
def _retile(array: np.ndarray, steps: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> np.ndarray:
    """Apply (reshape to shape, then transpose by axes) steps in order."""
    for shape, axes in steps:
        array = array.reshape(shape).transpose(axes)
    return array


def _pair_codes(values: np.ndarray) -> np.ndarray:
    """Ternary [M, K] -> uint8 [M, K/2]: consecutive pairs (a, b) along K as 3a + b + 4."""
    pairs = values.reshape(values.shape[0], -1, 2)
    return (3 * pairs[..., 0] + pairs[..., 1] + 4).astype(np.uint8)


def _tl_pair_tiles(idx: np.ndarray, BM: int, BY: int, bm: int, by: int) -> np.ndarray:
    """Pair codes [M, K/2] cut into [M/BM][K/BY][BM/bm][BY/by][bm][by/2] (the common TL1/TL2 prefix)."""
    num_rows, num_pairs = idx.shape
    tm, tk = num_rows // BM, 2 * num_pairs // BY
    return _retile(
        idx,
        [
            ((tm, BM, num_pairs), (0, 2, 1)),  # row tiles of BM, pairs outer
            ((tm, tk, BY // 2, BM), (0, 1, 3, 2)),  # column tiles of BY
            ((tm, tk, BM // bm, bm, BY // 2), (0, 1, 2, 4, 3)),  # bm-row SIMD blocks
            ((tm, tk, BM // bm, BY // by, by // 2, bm), (0, 1, 2, 3, 5, 4)),  # by-column chunks
        ],
    )


def pack_tl1(values: np.ndarray, scale: float, cfg: TileConfig) -> bytes:
    """Ternary int [M, K] -> TL1 data (M*K/4 bytes) + the 32-byte slot holding the f32 scale."""
    values = _as_ternary(values)
    num_rows, num_cols = values.shape
    problem = tl_geometry_error("TL1", num_rows, num_cols, cfg.BM, cfg.BK, cfg.bm)
    if problem:
        raise ValueError(problem)
    BM, BY, bm = cfg.BM, cfg.BK, cfg.bm  # BitNet calls BK "BY"
    by = 256 // bm
    tiles = _tl_pair_tiles(_pair_codes(values), BM, BY, bm, by)  # [tm][tk][sm][sk][bm][by/2]
    lead = tiles.shape[:4]
    tiles = _retile(
        tiles,
        [
            ((*lead, bm // 16, 16, by // 2), (0, 1, 2, 3, 4, 6, 5)),  # 16-row groups, pairs before rows
            ((*lead, bm // 16, by // 4, 2, 16), (0, 1, 2, 3, 4, 5, 7, 6)),  # two pairs per byte, last
        ],
    )
    byte_pairs = tiles.reshape(-1, 2)
    packed = (byte_pairs[:, 0] << 4) | byte_pairs[:, 1]  # the first pair in the high nibble
    return packed.astype(np.uint8).tobytes() + _scale_slot(scale)


def _tl2_rows(nibble_pairs: np.ndarray) -> np.ndarray:
    """[..., 32, 2] nibble pairs -> uint8 [rows, 32]: high/low nibbles, 8-row groups stored as 0, 2, 1, 3."""
    packed = ((nibble_pairs[..., 0] << 4) | nibble_pairs[..., 1]).astype(np.uint8)
    groups = packed.reshape(-1, 4, 8)
    return groups[:, _TL2_ROW_GROUP_PERM, :].reshape(-1, 32)


def _tl2_three(values: np.ndarray, BM: int, BY: int) -> tuple[np.ndarray, np.ndarray]:
    """Triple-coded columns [M, K3] -> (magnitude rows [M*K3/192, 32], sign bytes [M*K3/24])."""
    num_rows, k3 = values.shape
    bm, by = 32, 6
    triples = values.reshape(num_rows, k3 // 3, 3)
    code = 9 * triples[..., 0] + 3 * triples[..., 1] + triples[..., 2]  # [M, K3/3] in [-13, 13]
    magnitude, sign = np.abs(code).astype(np.uint8), (code < 0).astype(np.uint16)
    tm, tk = num_rows // BM, k3 // BY
    mag_tiles = _retile(
        magnitude,
        [
            ((tm, BM, k3 // 3), (0, 2, 1)),
            ((tm, tk, BY // 3, BM), (0, 1, 3, 2)),
            ((tm, tk, BM // bm, bm, BY // 3), (0, 1, 2, 4, 3)),
            ((tm, tk, BM // bm, BY // by, by // 3, bm), (0, 1, 2, 3, 5, 4)),  # [..., 32 rows, 2 triples]
        ],
    )
    sign_tiles = _retile(
        sign,
        [
            ((tm, BM, k3 // 3), (0, 2, 1)),
            ((tm, tk, BY // 3, BM), (0, 1, 3, 2)),
            ((tm, tk, BM // bm, bm, BY // 3), (0, 1, 2, 4, 3)),  # [tm][tk][sm][triple in tile][32 rows]
        ],
    )
    # 8 triples x 32 rows = 256 signs per group, read as 16 x 16: bit 15-i of word j is sign 16i + j
    sign_tiles = sign_tiles.reshape(tm, tk, BM // bm, BY // (by * 4), 16, 16)
    words = np.zeros(sign_tiles.shape[:4] + (16,), dtype=np.uint16)
    for i in range(16):
        words += sign_tiles[..., i, :] << np.uint16(15 - i)
    return _tl2_rows(mag_tiles), words.astype("<u2").view(np.uint8).reshape(-1)


def pack_tl2(values: np.ndarray, scale: float, cfg: TileConfig) -> bytes:
    """Ternary int [M, K] -> TL2 data zero-padded to pad32(S_TL2), then the 32-byte slot with the f32 scale.

    Columns up to K3 = K - K % BK are coded in triples (magnitudes, then signs), the K2 = K % BK rest in
    pairs with a fixed 32x32 tiling.
    """
    values = _as_ternary(values)
    num_rows, num_cols = values.shape
    problem = tl_geometry_error("TL2", num_rows, num_cols, cfg.BM, cfg.BK, cfg.bm)
    if problem:
        raise ValueError(problem)
    k3 = num_cols - num_cols % cfg.BK
    stored = tl2_stored_bytes(num_rows, num_cols)
    if tl2_used_bytes(num_rows, num_cols, cfg.BK) > stored:
        raise ValueError(f"TL2 shape ({num_rows}, {num_cols}) with BK={cfg.BK} does not fit S_TL2")
    parts: list[np.ndarray] = []
    if k3:
        mag_rows, sign_bytes = _tl2_three(np.ascontiguousarray(values[:, :k3]), cfg.BM, cfg.BK)
        parts += [mag_rows.reshape(-1), sign_bytes]
    if num_cols > k3:
        pair_tiles = _tl_pair_tiles(_pair_codes(values[:, k3:]), cfg.BM, 32, 32, 4)  # [..., 32 rows, 2]
        parts.append(_tl2_rows(pair_tiles).reshape(-1))
    data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    padded = np.zeros(stored, dtype=np.uint8)
    padded[: data.size] = data
    return padded.tobytes() + _scale_slot(scale)
