"""Reference decoders of bitnet.cpp's ternary file layouts (docs/formats.md §2.2-2.3): I2_S in its three
packing variants, TL1 and TL2 under their tile configs; pure torch, any device. Each gives int8 codes
(code - 1, in {-1, 0, +1}); kernels/reference/dequant.py pairs them with the tensor scale. The geometry
checks and byte counts are the loader's too (loader/decode.py, loader/ternary_pack.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from bitserve.errors import InvalidModelFile
from bitserve.kernels.packed import PackedWeight
from bitserve.kernels.reference.packed_bytes import (
    SCALE_SLOT_BYTES,
    byte_bits,
    check_range,
    expect_nbytes,
    lookup_fields,
    pair_fields,
    tail_scale,
)

logger = logging.getLogger(__name__)

I2S_VARIANTS = ("A", "B", "C")
_TL2_ROW_GROUP_PERM = (0, 2, 1, 3)  # TL2 32-byte rows store 8-row groups in this order; an involution


def i2s_geometry_error(variant: str, num_rows: int, num_cols: int) -> str | None:
    """Why an (M, K) matrix cannot be I2_S in `variant`, or None."""
    if variant not in I2S_VARIANTS:
        return f"unknown I2_S variant {variant!r}; expected one of {I2S_VARIANTS}"
    if variant == "A" and num_cols % 128:
        return f"I2_S variant A needs K % 128 == 0, got K={num_cols}"
    if variant == "B" and num_cols % 64:
        return f"I2_S variant B needs K % 64 == 0, got K={num_cols}"
    if variant == "C" and num_rows % 4:
        return f"I2_S variant C needs M % 4 == 0, got M={num_rows}"
    return None


def i2s_code_three_error() -> InvalidModelFile:
    """What an I2_S tensor holding code 3 raises (here and in kernels/cpu/mapped.py)."""
    return InvalidModelFile(
        "I2_S code 3: wrong packing or offsets",
        hint="code 3 never occurs in bitnet.cpp's I2_S; check the tensor offset and size",
    )


def i2s_values(packed: torch.Tensor, variant: str, num_rows: int, num_cols: int) -> torch.Tensor:
    """int8 [num_rows, num_cols] of code - 1 from I2_S bytes uint8 [num_rows*num_cols/4] (code 3 gives 2)."""
    crumbs = byte_bits((6, 4, 2, 0), 3) - 1  # MSB first
    if variant == "A":  # 128-value blocks: byte 32b+m holds elements m, m+32, m+64, m+96
        values = lookup_fields(packed.view(-1, 32), crumbs).transpose(1, 2)
    elif variant == "B":  # 64-value blocks of 16 bytes
        values = lookup_fields(packed.view(-1, 16), crumbs).transpose(1, 2)
    elif variant == "C":  # byte g*K + c holds rows 4g..4g+3 of column c
        values = lookup_fields(packed.view(num_rows // 4, num_cols), crumbs).transpose(1, 2)
    else:
        raise ValueError(f"unknown I2_S variant {variant!r}; expected one of {I2S_VARIANTS}")
    return values.reshape(num_rows, num_cols)


def i2s_scale(weight: PackedWeight) -> torch.Tensor:
    """The f32 tensor scale of an I2_S weight (the first 4 bytes after its M * K / 4 packed codes)."""
    num_rows, num_cols = weight.shape
    return tail_scale(weight.data, num_rows * num_cols // 4, "I2_S")


def i2s_codes(weight: PackedWeight, row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """int8 [M, K] of code - 1 of an I2_S weight (only rows `row_ids` when given), after the geometry,
    byte-count and code-3 checks."""
    num_rows, num_cols = weight.shape
    variant = weight.params.get("i2s_variant", "A")
    problem = i2s_geometry_error(variant, num_rows, num_cols)
    if problem:
        raise InvalidModelFile(problem, hint="choose the I2_S packing variant the file was written with")
    expect_nbytes(weight, num_rows * num_cols // 4 + SCALE_SLOT_BYTES)
    packed = weight.data[: num_rows * num_cols // 4]
    if row_ids is not None and variant in ("A", "B"):  # whole blocks per row: decode only the wanted rows
        packed = packed.view(num_rows, num_cols // 4).index_select(0, row_ids).reshape(-1)
        num_rows = row_ids.numel()
    values = i2s_values(packed, variant, num_rows, num_cols)
    if values.numel() and int(values.max()) > 1:
        raise i2s_code_three_error()
    if row_ids is not None and variant == "C":
        values = values.index_select(0, row_ids)
    return values


def tl_geometry_error(kind: str, num_rows: int, num_cols: int, BM: int, BK: int, bm: int) -> str | None:
    """Why tile config (BM, BK, bm) cannot tile an (M, K) TL1/TL2 matrix (docs/formats.md §2.3), or None."""
    if min(BM, BK, bm) <= 0:
        return f"tile config BM={BM} BK={BK} bm={bm} must be positive"
    if num_rows % BM or BM % bm:
        return f"M={num_rows} must be a multiple of BM={BM}, and BM of bm={bm}"
    if kind == "TL1":
        if bm not in (32, 64):
            return f"TL1 needs bm in (32, 64), got {bm}"
        by = 256 // bm
        if num_cols % BK or BK % by:
            return f"TL1 needs K={num_cols} % BK={BK} == 0 and BK % {by} == 0"
        return None
    if kind == "TL2":
        if bm != 32:
            return f"TL2 needs bm == 32, got {bm}"
        if BK % 24:
            return f"TL2 needs BK % 24 == 0, got BK={BK}"
        if (num_cols % BK) % 32:
            return f"TL2 needs K % BK to be a multiple of 32, got K={num_cols} % BK={BK} = {num_cols % BK}"
        return None
    return f"unknown TL kind {kind!r}"


def tl_tile(weight: PackedWeight) -> tuple[int, int, int]:
    """The (BM, BK, bm) tile config in a TL1 / TL2 weight's params, checked against its shape."""
    params = weight.params
    if not all(key in params for key in ("BM", "BK", "bm")):
        raise InvalidModelFile(
            f"{weight.layout.name} weight has no tile config (params BM, BK, bm)",
            hint="TL files do not record their tiling; pass a kernel_config.ini or a preset",
        )
    tile = (int(params["BM"]), int(params["BK"]), int(params["bm"]))
    problem = tl_geometry_error(weight.layout.name, *weight.shape, *tile)
    if problem:
        raise InvalidModelFile(f"{weight.layout.name} tensor of shape {weight.shape}: {problem}")
    return tile


def tl1_codes(weight: PackedWeight) -> torch.Tensor:
    """int8 [M, K] of code - 1 of a TL1 weight, in row-major order."""
    num_rows, num_cols = weight.shape
    BM, BK, bm = tl_tile(weight)
    by = 256 // bm
    expect_nbytes(weight, num_rows * num_cols // 4 + SCALE_SLOT_BYTES)
    # byte order [tm][tk][sm][sk][g16][kp][i16]; a byte holds pairs 2kp (high nibble) and 2kp+1 (low)
    tiles = weight.data[: num_rows * num_cols // 4].view(
        num_rows // BM, num_cols // BK, BM // bm, BK // by, bm // 16, by // 4, 16
    )
    # reorder the bytes to row = tm*BM + sm*bm + 16*g16 + i16, column = tk*BK + sk*by + 4*kp (+ 0..3 from
    # the byte), then decode each byte into its 4 columns in place
    row_major = tiles.permute(0, 2, 4, 6, 1, 3, 5).reshape(num_rows, num_cols // 4)
    values = lookup_fields(row_major, pair_fields()).reshape(num_rows, num_cols)
    check_range(values, "TL1 nibble > 8: wrong tile config or offsets")
    return values


def tl2_used_bytes(num_rows: int, num_cols: int, BK: int) -> int:
    k3 = num_cols - num_cols % BK
    return num_rows * k3 // 6 + num_rows * k3 // 24 + num_rows * (num_cols % BK) // 4


def tl2_stored_bytes(num_rows: int, num_cols: int) -> int:
    """pad32(S_TL2): bytes before the scale slot (bitnet.cpp's deliberate over-estimate,
    docs/formats.md §2.3)."""
    s_tl2 = ((num_cols - 256) * num_rows // 3) * 5 // 8 + (256 * num_rows // 2) * 4 // 8
    return (s_tl2 + 31) // 32 * 32


def _tl2_rows32(packed: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """TL2 rows of 32 bytes [*lead, 32] -> [*lead, 4, 8] in tile-row order (stored group g is row
    group perm[g])."""
    return packed.view(*lead, 4, 8)[..., list(_TL2_ROW_GROUP_PERM), :]


def _tl2_fields() -> np.ndarray:
    """Index mag_byte | sign(u=0) << 8 | sign(u=1) << 9 -> the 6 digits of the byte's two triples.

    A triple stores v = 9a + 3b + c as |v| (high nibble for u = 0) and a sign bit (1 = negative); digits are
    those of w = v + 13 = 9(a+1) + 3(b+1) + (c+1). A magnitude > 13 gives digits 2 (the range check's mark).
    """
    index = np.arange(1024)
    mags = np.stack(((index >> 4) & 15, index & 15), axis=1)  # [1024, u]
    signs = np.stack(((index >> 8) & 1, (index >> 9) & 1), axis=1)
    w = mags * (1 - 2 * signs) + 13
    digits = np.stack((w // 9 - 1, (w // 3) % 3 - 1, w % 3 - 1), axis=-1)  # [1024, u, 3]
    digits[mags > 13] = 2
    return digits.reshape(1024, 6).astype(np.int8)


def _tl2_sign_bits(packed: torch.Tensor, num_rows: int, k3: int, BM: int, BK: int) -> torch.Tensor:
    """Sign words -> uint8 [M, K3/6, 2]: the sign bit of triple 2*sk + u, laid out like the magnitude bytes.

    Groups [tm][tk][sm][s4] of 16 LE u16 words; bit 15-i of word j is the sign of f = 16i + j, which is triple
    8*s4 + f//32 of tile row f%32. With i = 8*hl + t (hl = 0: high byte) and t = 4*t2h + 2*u + tb, that is
    triple 2*(4*s4 + 2*hl + t2h) + u of row 16*tb + j.
    """
    groups = packed.view(num_rows // BM, k3 // BK, BM // 32, BK // 24, 16, 2)[..., [1, 0]]  # (hi, lo) bytes
    bits = lookup_fields(groups, byte_bits((7, 6, 5, 4, 3, 2, 1, 0), 1))  # [tm, tk, sm, s4, j, hl, t]
    bits = bits.reshape(*bits.shape[:6], 2, 2, 2)  # t -> (t2h, u, tb)
    # to [tm, sm, tb, j | tk, s4, hl, t2h, u] = [row | column of the magnitude byte, u]
    return bits.permute(0, 2, 8, 4, 1, 3, 5, 6, 7).reshape(num_rows, k3 // 6, 2).view(torch.uint8)


def _tl2_triples(packed: torch.Tensor, out: torch.Tensor, BM: int, BK: int) -> None:
    """Magnitude nibbles then sign words -> `out` int8 [M, K3] (a view of the result)."""
    num_rows, k3 = out.shape
    num_mag_bytes = num_rows * k3 // 6
    lead = (num_rows // BM, k3 // BK, BM // 32, BK // 6)  # [tm][tk][sm][sk]
    mag_rows = _tl2_rows32(packed[:num_mag_bytes], lead).reshape(*lead, 32)  # [tm, tk, sm, sk, m]
    # bytes to row = tm*BM + sm*32 + m, column = tk*BK + 6*sk (+ 0..5 from the byte: 3*u + digit)
    mag_bytes = mag_rows.permute(0, 2, 4, 1, 3).reshape(num_rows, k3 // 6)
    signs = _tl2_sign_bits(packed[num_mag_bytes : num_mag_bytes + num_rows * k3 // 24], num_rows, k3, BM, BK)
    zero_mags = torch.stack(((mag_bytes >> 4) == 0, (mag_bytes & 15) == 0), dim=-1)  # [M, K3/6, u]
    if bool((zero_mags & (signs == 1)).any()):
        logger.warning(
            "TL2 tensor with %d rows has sign bits on zero magnitudes: the tile config may be wrong", num_rows
        )
    index = mag_bytes.to(torch.int32) | (signs[..., 0] | signs[..., 1] << 1).to(torch.int32) << 8
    out.view(num_rows, k3 // 6, 6).copy_(lookup_fields(index, _tl2_fields()))
    check_range(out, "TL2 magnitude > 13: wrong tile config or offsets")


def tl2_codes(weight: PackedWeight) -> torch.Tensor:
    """int8 [M, K] of code - 1 of a TL2 weight: the triple-coded first K3 columns, then the pair-coded
    rest, after the byte-count and zero-padding checks."""
    num_rows, num_cols = weight.shape
    BM, BK, _ = tl_tile(weight)
    k2 = num_cols % BK
    k3 = num_cols - k2
    stored, used = tl2_stored_bytes(num_rows, num_cols), tl2_used_bytes(num_rows, num_cols, BK)
    expect_nbytes(weight, stored + SCALE_SLOT_BYTES)
    if used > stored:
        raise InvalidModelFile(f"TL2 shape {weight.shape} with BK={BK} needs {used} bytes, more than S_TL2")
    packed = weight.data
    if bool(packed[used:stored].any()):
        raise InvalidModelFile("TL2 padding after the packed data is not zero: wrong tile config or offsets")
    values = torch.empty((num_rows, num_cols), dtype=torch.int8, device=packed.device)
    if k3:
        _tl2_triples(packed, values[:, :k3], BM, BK)
    if k2:  # pair codes, TL1's idx with a fixed 32-row x 32-column tiling
        start = num_rows * k3 // 6 + num_rows * k3 // 24
        rows = _tl2_rows32(packed[start:used], (num_rows // BM, k2 // 32, BM // 32, 8))  # [.., 4, 8]
        # bytes to row = tm*BM + sm*32 + m, column = K3 + 32*tk2 + 4*sk (+ 0..3 from the byte)
        pair_bytes = rows.reshape(num_rows // BM, k2 // 32, BM // 32, 8, 32).permute(0, 2, 4, 1, 3)
        pairs = lookup_fields(pair_bytes.reshape(num_rows, k2 // 4), pair_fields())  # [M, K2/4, 4]
        check_range(pairs, "TL2 pair nibble > 8: wrong tile config or offsets")
        values[:, k3:] = pairs.reshape(num_rows, k2)
    return values
