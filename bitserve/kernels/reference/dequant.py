"""Reference decoders for every GGUF file layout (docs/formats.md §2): pure torch, vectorized, any device.

`dequantize` gives float32 [M, K] that matches ggml / gguf-py bit for bit; `unpack_ternary` gives the common
{-1, 0, +1} form of I2_S / TL1 / TL2 / TQ1_0 / TQ2_0; `dense_rows` decodes only some rows (embedding lookups).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from bitserve.errors import InvalidModelFile
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes

logger = logging.getLogger(__name__)

SCALE_SLOT_BYTES = (
    32  # bitnet.cpp formats end with a 32-byte slot whose first 4 bytes are the f32 tensor scale
)
I2S_VARIANTS = ("A", "B", "C")
# (values per block, bytes per block) of the row-decodable formats (ggml-common.h)
BLOCK_GEOMETRY: dict[Layout, tuple[int, int]] = {
    Layout.F32: (1, 4),
    Layout.F16: (1, 2),
    Layout.BF16: (1, 2),
    Layout.Q8_0: (32, 34),
    Layout.Q4_0: (32, 18),
    Layout.Q4_1: (32, 20),
    Layout.Q5_0: (32, 22),
    Layout.Q4_K: (256, 144),
    Layout.Q6_K: (256, 210),
    Layout.TQ1_0: (256, 54),
    Layout.TQ2_0: (256, 66),
}
_TL2_ROW_GROUP_PERM = (0, 2, 1, 3)  # TL2 32-byte rows store 8-row groups in this order; an involution
_CHUNK_VALUES = 1 << 22  # decode block formats this many values at a time to bound temporaries
_POW3 = (1, 3, 9, 27, 81)


# ----------------------------------------------------------------------------------------------- helpers
def _f16(fields: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 2] little-endian f16 fields -> float32 [N, 1] (exact)."""
    return fields.contiguous().view(torch.float16).float()


def _lookup(index: torch.Tensor, fields: np.ndarray) -> torch.Tensor:
    """uint8 / int32 [...] -> int8 [..., F]: row `index` of the table `fields` (int8 [T, F], F <= 8).

    One gather of 4- or 8-byte table items decodes a whole byte (or code group) at once; on CPU it is several
    times faster than the equivalent shift / mask / stack passes.
    """
    num_fields = fields.shape[1]
    width = 4 if num_fields <= 4 else 8
    padded = np.zeros((fields.shape[0], width), dtype=np.int8)
    padded[:, :num_fields] = fields
    table = torch.from_numpy(padded.view(np.int32 if width == 4 else np.int64).reshape(-1)).to(index.device)
    items = table.index_select(0, index.reshape(-1).to(torch.int32))
    return items.view(torch.int8).view(*index.shape, width)[..., :num_fields]


def _byte_bits(shifts: tuple[int, ...], mask: int) -> np.ndarray:
    """int16 [256, len(shifts)]: (byte >> shift) & mask for every byte value."""
    return (np.arange(256, dtype=np.int16)[:, None] >> np.array(shifts, dtype=np.int16)) & mask


def _pair_fields() -> np.ndarray:
    """TL pair table: byte -> [a, b] of the high-nibble pair, then of the low one; idx = 3a + b + 4.

    A nibble > 8 gives a >= 2, which the callers' range check catches.
    """
    idx = _byte_bits((4, 0), 15)  # [256, (hi, lo)]
    return np.stack((idx // 3 - 1, idx % 3 - 1), axis=-1).reshape(256, 4).astype(np.int8)


def _check_range(values: torch.Tensor, message: str) -> None:
    """Every table above marks an out-of-range code with a value >= 2."""
    if values.numel() and int(values.max()) > 1:
        raise InvalidModelFile(message)


def _tail_scale(data: torch.Tensor, offset: int, what: str) -> torch.Tensor:
    """The f32 tensor scale stored at byte `offset`, as a 0-dim float32 tensor."""
    scale = data[offset : offset + 4].clone().view(torch.float32).reshape(())
    if not torch.isfinite(scale):
        raise InvalidModelFile(f"{what} tensor scale is {scale.item()} (not finite): wrong offsets or size")
    return scale


def expect_nbytes(weight: PackedWeight, expected: int) -> None:
    """ValueError for data that is not uint8 [nbytes]; InvalidModelFile unless it holds `expected`
    bytes (the decoders here and kernels/cpu/mapped.py's in-place I2_S)."""
    if weight.data.dim() != 1 or weight.data.dtype != torch.uint8:
        raise ValueError(
            f"{weight.layout.name} data must be uint8 [nbytes], got {weight.data.dtype} "
            f"{tuple(weight.data.shape)}"
        )
    if weight.data.numel() != expected:
        raise InvalidModelFile(
            f"{weight.layout.name} tensor of shape {weight.shape} holds {weight.data.numel()} bytes",
            expected=f"{expected} bytes",
        )


# ------------------------------------------------------------------------------------- block formats
def _low_nibbles_first(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0/Q4_1/Q5_0 low bits, uint8 [N, 16] -> [N, 32]: value j < 16 is the low nibble of qs[j],
    j+16 the high."""
    return torch.cat((qs & 15, qs >> 4), dim=1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(blocks[:, :2]))


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _low_nibbles_first(blocks[:, 2:]).float().sub_(8).mul_(_f16(blocks[:, :2]))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _low_nibbles_first(blocks[:, 4:]).float()
    return q.mul_(_f16(blocks[:, :2])).add_(_f16(blocks[:, 2:4]))  # q*d + m, two roundings as in ggml


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    num_blocks = blocks.shape[0]
    bit_ids = torch.arange(8, dtype=torch.uint8, device=blocks.device)
    high = ((blocks[:, 2:6, None] >> bit_ids) & 1).reshape(num_blocks, 32)  # bit j of LE u32 qh
    q = _low_nibbles_first(blocks[:, 6:]) | (high << 4)
    return q.float().sub_(16).mul_(_f16(blocks[:, :2]))


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    num_blocks = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    s = blocks[:, 4:16].to(torch.int32)  # [N, 12] packed 6-bit scales and mins
    sc = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)), dim=1)  # [N, 8]
    mn = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), dim=1)  # [N, 8]
    qs = blocks[:, 16:].reshape(num_blocks, 4, 1, 32)  # group g: low nibbles sub-block 2g, high 2g+1
    q = torch.cat((qs & 15, qs >> 4), dim=2).reshape(num_blocks, 8, 32).float()
    q.mul_((d * sc.float())[:, :, None]).sub_((dmin * mn.float())[:, :, None])
    return q.reshape(num_blocks, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    num_blocks = blocks.shape[0]
    ql = blocks[:, :128].reshape(num_blocks, 2, 2, 32)  # [N, half, l+32*(s%2), 32]
    low4 = torch.cat((ql & 15, ql >> 4), dim=2)  # [N, half, s, 32]: s<2 low nibbles, s>=2 high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    top2 = (blocks[:, 128:192].reshape(num_blocks, 2, 1, 32) >> shifts) & 3  # [N, half, s, 32]
    q = (low4 | top2 << 4).reshape(num_blocks, 16, 16).float().sub_(32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [N, 16]
    q.mul_((_f16(blocks[:, 208:210]) * scales)[:, :, None])
    return q.reshape(num_blocks, 256)


def _tq1_fields() -> np.ndarray:
    """byte q -> its 5 trits minus 1, trit n = ((q * 3^n mod 256) * 3) >> 8 (first trit most significant)."""
    q = np.arange(256, dtype=np.int32)[:, None]
    return ((((q * np.array(_POW3, dtype=np.int32)) & 255) * 3 >> 8) - 1).astype(np.int8)


def _tq_values(blocks: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """TQ blocks uint8 [N, type_size] -> (code - 1 as int8 [N, 256], d float32 [N, 1]).

    TQ2_0 code 3 comes out as 2, which ggml would also read as +2.
    """
    num_blocks = blocks.shape[0]
    if layout is Layout.TQ2_0:  # qs[32h+m] holds element 128h+32l+m at shift 2l (LSB first)
        crumbs = _lookup(blocks[:, :64].reshape(num_blocks, 2, 32), (_byte_bits((0, 2, 4, 6), 3) - 1))
        return crumbs.transpose(2, 3).reshape(num_blocks, 256), _f16(blocks[:, 64:66])
    trits = _lookup(blocks[:, :52], _tq1_fields())  # [N, 52, 5]
    parts = (
        trits[:, :32].transpose(1, 2),  # trit n of qs[m]: element 32n + m
        trits[:, 32:48].transpose(1, 2),  # trit n of qs[32+m]: element 160 + 16n + m
        trits[:, 48:52, :4].transpose(1, 2),  # trit n of qh[j]: element 240 + 4n + j
    )
    values = torch.cat([part.reshape(num_blocks, -1) for part in parts], dim=1)
    return values, _f16(blocks[:, 52:54])


def _decode_rows(layout: Layout, rows: torch.Tensor, num_cols: int) -> torch.Tensor:
    """uint8 [R, row_bytes] of a row-decodable layout -> float32 [R, num_cols]."""
    num_rows = rows.shape[0]
    if layout is Layout.F32:
        return rows.view(torch.float32).clone()
    if layout is Layout.F16:
        return rows.view(torch.float16).float()
    if layout is Layout.BF16:
        return (rows.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    block, type_size = BLOCK_GEOMETRY[layout]
    blocks = rows.reshape(num_rows * (num_cols // block), type_size)
    if layout in (Layout.TQ1_0, Layout.TQ2_0):
        values, d = _tq_values(blocks, layout)
        out = values.float().mul_(d)  # ggml: (code - 1) * d
    else:
        decoder = {
            Layout.Q8_0: _q8_0,
            Layout.Q4_0: _q4_0,
            Layout.Q4_1: _q4_1,
            Layout.Q5_0: _q5_0,
            Layout.Q4_K: _q4_k,
            Layout.Q6_K: _q6_k,
        }[layout]
        out = decoder(blocks)
    return out.reshape(num_rows, num_cols)


def row_bytes_of(weight: PackedWeight) -> int:
    """Bytes of one row of a row-decodable weight (block and float layouts), after checking K."""
    _, num_cols = weight.shape
    block, type_size = BLOCK_GEOMETRY[weight.layout]
    if num_cols % block:
        raise InvalidModelFile(f"{weight.layout.name} needs K to be a multiple of {block}, got K={num_cols}")
    return num_cols // block * type_size


def decode_row_bytes(weight: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """uint8 [R, row_bytes_of(weight)] read from weight's rows elsewhere (GGUFFile.read_rows) -> float32
    [R, K], as dense_rows decodes them."""
    return _decode_rows(weight.layout, rows, weight.shape[1])


def _row_matrix(weight: PackedWeight) -> torch.Tensor:
    """The bytes of a row-decodable weight as uint8 [M, row_bytes], after checking the geometry."""
    num_rows, _ = weight.shape
    row_bytes = row_bytes_of(weight)
    expect_nbytes(weight, num_rows * row_bytes)
    data = weight.data
    if data.storage_offset() % 4:  # dtype views of F32/F16 rows need an aligned start
        data = data.clone()
    return data.view(num_rows, row_bytes)


# ----------------------------------------------------------------------------- bitnet.cpp ternary formats
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
    crumbs = _byte_bits((6, 4, 2, 0), 3) - 1  # MSB first
    if variant == "A":  # 128-value blocks: byte 32b+m holds elements m, m+32, m+64, m+96
        values = _lookup(packed.view(-1, 32), crumbs).transpose(1, 2)
    elif variant == "B":  # 64-value blocks of 16 bytes
        values = _lookup(packed.view(-1, 16), crumbs).transpose(1, 2)
    elif variant == "C":  # byte g*K + c holds rows 4g..4g+3 of column c
        values = _lookup(packed.view(num_rows // 4, num_cols), crumbs).transpose(1, 2)
    else:
        raise ValueError(f"unknown I2_S variant {variant!r}; expected one of {I2S_VARIANTS}")
    return values.reshape(num_rows, num_cols)


def i2s_scale(weight: PackedWeight) -> torch.Tensor:
    """The f32 tensor scale of an I2_S weight (the first 4 bytes after its M * K / 4 packed codes)."""
    num_rows, num_cols = weight.shape
    return _tail_scale(weight.data, num_rows * num_cols // 4, "I2_S")


def _i2s_values(weight: PackedWeight, row_ids: torch.Tensor | None = None) -> torch.Tensor:
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


def _tile(weight: PackedWeight) -> tuple[int, int, int]:
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


def _tl1_values(weight: PackedWeight) -> torch.Tensor:
    num_rows, num_cols = weight.shape
    BM, BK, bm = _tile(weight)
    by = 256 // bm
    expect_nbytes(weight, num_rows * num_cols // 4 + SCALE_SLOT_BYTES)
    # byte order [tm][tk][sm][sk][g16][kp][i16]; a byte holds pairs 2kp (high nibble) and 2kp+1 (low)
    tiles = weight.data[: num_rows * num_cols // 4].view(
        num_rows // BM, num_cols // BK, BM // bm, BK // by, bm // 16, by // 4, 16
    )
    # reorder the bytes to row = tm*BM + sm*bm + 16*g16 + i16, column = tk*BK + sk*by + 4*kp (+ 0..3 from
    # the byte), then decode each byte into its 4 columns in place
    row_major = tiles.permute(0, 2, 4, 6, 1, 3, 5).reshape(num_rows, num_cols // 4)
    values = _lookup(row_major, _pair_fields()).reshape(num_rows, num_cols)
    _check_range(values, "TL1 nibble > 8: wrong tile config or offsets")
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
    bits = _lookup(groups, _byte_bits((7, 6, 5, 4, 3, 2, 1, 0), 1))  # [tm, tk, sm, s4, j, hl, t]
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
    out.view(num_rows, k3 // 6, 6).copy_(_lookup(index, _tl2_fields()))
    _check_range(out, "TL2 magnitude > 13: wrong tile config or offsets")


def _tl2_values(weight: PackedWeight) -> torch.Tensor:
    num_rows, num_cols = weight.shape
    BM, BK, _ = _tile(weight)
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
        pairs = _lookup(pair_bytes.reshape(num_rows, k2 // 4), _pair_fields())  # [M, K2/4, 4]
        _check_range(pairs, "TL2 pair nibble > 8: wrong tile config or offsets")
        values[:, k3:] = pairs.reshape(num_rows, k2)
    return values


# ------------------------------------------------------------------------------------------ public API
def _check_file_layout(weight: PackedWeight) -> None:
    if weight.layout not in BLOCK_GEOMETRY and weight.layout not in (Layout.I2_S, Layout.TL1, Layout.TL2):
        raise ValueError(
            f"{weight.layout} is not a file layout; runtime layouts are decoded by their backend"
        )


def unpack_ternary(weight: PackedWeight) -> TernaryCodes:
    """int8 [M, K] in {-1, 0, 1} and the scale (see TernaryCodes) of a ternary file layout.

    TQ1_0/TQ2_0: codes of blocks with d == 0 are set to 0; the scale is a scalar when every block with a
    nonzero code has the same d (0.0 when none has), else per-block float32 [M, K // 256].
    """
    num_rows, num_cols = weight.shape
    layout = weight.layout
    if layout is Layout.I2_S:
        return TernaryCodes(_i2s_values(weight), i2s_scale(weight))
    if layout is Layout.TL1:
        values = _tl1_values(weight)
        return TernaryCodes(values, _tail_scale(weight.data, num_rows * num_cols // 4, "TL1"))
    if layout is Layout.TL2:
        values = _tl2_values(weight)
        return TernaryCodes(values, _tail_scale(weight.data, tl2_stored_bytes(num_rows, num_cols), "TL2"))
    if layout not in (Layout.TQ1_0, Layout.TQ2_0):
        raise ValueError(f"{layout} is not a ternary file layout")
    blocks = _row_matrix(weight).reshape(-1, BLOCK_GEOMETRY[layout][1])
    values, d = _tq_values(blocks, layout)
    _check_range(values, "TQ2_0 code 3 is not ternary (ggml would read it as +2)")
    d = d.reshape(-1)  # [num_blocks]
    values = values * (d != 0).to(torch.int8)[:, None]  # blocks with d == 0 decode to zeros
    has_nonzero = values.any(dim=1)
    live_d = d[has_nonzero]
    values = values.reshape(num_rows, num_cols)
    if live_d.numel() == 0:
        return TernaryCodes(values, torch.zeros((), dtype=torch.float32, device=d.device))
    if bool((live_d == live_d[0]).all()):
        return TernaryCodes(values, live_d[0].clone())
    return TernaryCodes(values, d.reshape(num_rows, num_cols // 256).clone())


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """float32 [M, K] of any file layout; equal bit for bit to ggml's dequantize_row_* / gguf-py.

    1-D tensors (norms) have shape (1, n) and come back as [1, n].
    """
    _check_file_layout(weight)
    if weight.layout in (Layout.I2_S, Layout.TL1, Layout.TL2):
        codes = unpack_ternary(weight)
        return codes.values.float().mul_(codes.scale)
    rows = _row_matrix(weight)  # [M, row_bytes]
    num_rows, num_cols = weight.shape
    out = torch.empty((num_rows, num_cols), dtype=torch.float32, device=rows.device)
    rows_per_chunk = max(1, _CHUNK_VALUES // max(num_cols, 1))
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        out[start:stop] = _decode_rows(weight.layout, rows[start:stop], num_cols)
    return out


def dense_rows(weight: PackedWeight, row_ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(row_ids), K]: rows `row_ids` of dequantize(weight), decoding only those rows.

    Block formats and I2_S variants A/B decode row by row; I2_S C and TL1/TL2 tile several rows
    together, so they decode the whole matrix and select.
    """
    _check_file_layout(weight)
    num_rows, num_cols = weight.shape
    row_ids = row_ids.reshape(-1).to(torch.int64)
    if row_ids.numel() and (int(row_ids.min()) < 0 or int(row_ids.max()) >= num_rows):
        raise IndexError(
            f"row ids must lie in [0, {num_rows}), got {int(row_ids.min())}..{int(row_ids.max())}"
        )
    if weight.layout is Layout.I2_S:
        scale = _tail_scale(weight.data, num_rows * num_cols // 4, "I2_S")
        return _i2s_values(weight, row_ids).float() * scale
    if weight.layout in (Layout.TL1, Layout.TL2):
        return dequantize(weight).index_select(0, row_ids)
    rows = _row_matrix(weight).index_select(0, row_ids)
    return _decode_rows(weight.layout, rows, num_cols)
