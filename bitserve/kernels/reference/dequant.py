"""Reference decoders for every GGUF file layout (docs/formats.md §2): pure torch, vectorized, any device.

`dequantize` gives float32 [M, K] that matches ggml / gguf-py bit for bit; `unpack_ternary` gives the common
{-1, 0, +1} form of I2_S / TL1 / TL2 / TQ1_0 / TQ2_0; `dense_rows` decodes only some rows (embedding lookups).
"""

from __future__ import annotations

import numpy as np
import torch

from bitserve.errors import InvalidModelFile
from bitserve.kernels.packed import LOW_BIT_LAYOUTS, Layout, PackedWeight, TernaryCodes
from bitserve.kernels.reference import k_quants

# The byte-level pieces and the bitnet.cpp layouts live in packed_bytes.py and bitnet_formats.py; the names
# other modules import from here are re-exported.
from bitserve.kernels.reference.bitnet_formats import (  # noqa: F401 - re-exported
    I2S_VARIANTS,
    i2s_code_three_error,
    i2s_codes,
    i2s_geometry_error,
    i2s_scale,
    i2s_values,
    tl1_codes,
    tl2_codes,
    tl2_stored_bytes,
    tl2_used_bytes,
    tl_geometry_error,
)
from bitserve.kernels.reference.packed_bytes import (  # noqa: F401 - re-exported
    SCALE_SLOT_BYTES,
    byte_bits,
    check_range,
    expect_nbytes,
    f16_to_f32,
    lookup_fields,
    tail_scale,
)

# (values per block, bytes per block) of the row-decodable formats (ggml-common.h)
BLOCK_GEOMETRY: dict[Layout, tuple[int, int]] = {
    Layout.F32: (1, 4),
    Layout.F16: (1, 2),
    Layout.BF16: (1, 2),
    Layout.Q8_0: (32, 34),
    Layout.Q4_0: (32, 18),
    Layout.Q4_1: (32, 20),
    Layout.Q5_0: (32, 22),
    Layout.Q5_1: (32, 24),
    Layout.Q2_K: (256, 84),
    Layout.Q3_K: (256, 110),
    Layout.Q4_K: (256, 144),
    Layout.Q5_K: (256, 176),
    Layout.Q6_K: (256, 210),
    Layout.TQ1_0: (256, 54),
    Layout.TQ2_0: (256, 66),
    Layout.Q1_0: (128, 18),
    Layout.Q2_0: (64, 18),
}
_CHUNK_VALUES = 1 << 22  # decode block formats this many values at a time to bound temporaries
_POW3 = (1, 3, 9, 27, 81)


# ------------------------------------------------------------------------------------- block formats
def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(f16_to_f32(blocks[:, :2]))


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return k_quants.low_high(blocks[:, 2:]).float().sub_(8).mul_(f16_to_f32(blocks[:, :2]))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = k_quants.low_high(blocks[:, 4:]).float()
    # q*d + m, two roundings as in ggml
    return q.mul_(f16_to_f32(blocks[:, :2])).add_(f16_to_f32(blocks[:, 2:4]))


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = k_quants.five_bit_codes(blocks[:, 2:6], blocks[:, 6:])  # qh a little-endian u32
    return q.float().sub_(16).mul_(f16_to_f32(blocks[:, :2]))


def low_bit_codes(blocks: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Q1_0 / Q2_0 blocks -> each value's code (its level before d) as int8 [N, values]: Q1_0's bit j of
    qs[j / 8] (LSB first) as +-1, Q2_0's 2-bit field at bits 2 (j % 4) of qs[j / 4] as code - 1."""
    if layout is Layout.Q1_0:
        bits = lookup_fields(blocks[:, 2:], byte_bits(tuple(range(8)), 1))  # [N, 16, 8], value 8i + b
        return bits.reshape(blocks.shape[0], 128).to(torch.int8) * 2 - 1
    codes = lookup_fields(blocks[:, 2:], byte_bits((0, 2, 4, 6), 3))  # [N, 16, 4], value 4i + s
    return codes.reshape(blocks.shape[0], 64).to(torch.int8) - 1


def _q1_0(blocks: torch.Tensor) -> torch.Tensor:
    """d f16 [2 bytes], then the signs: values +-d (ggml)."""
    return low_bit_codes(blocks, Layout.Q1_0).float().mul_(f16_to_f32(blocks[:, :2]))


def _q2_0(blocks: torch.Tensor) -> torch.Tensor:
    """d f16, then the 2-bit codes: value (code - 1) d, code 3 -> +2 d (ggml)."""
    return low_bit_codes(blocks, Layout.Q2_0).float().mul_(f16_to_f32(blocks[:, :2]))


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
        crumbs = lookup_fields(blocks[:, :64].reshape(num_blocks, 2, 32), (byte_bits((0, 2, 4, 6), 3) - 1))
        return crumbs.transpose(2, 3).reshape(num_blocks, 256), f16_to_f32(blocks[:, 64:66])
    trits = lookup_fields(blocks[:, :52], _tq1_fields())  # [N, 52, 5]
    parts = (
        trits[:, :32].transpose(1, 2),  # trit n of qs[m]: element 32n + m
        trits[:, 32:48].transpose(1, 2),  # trit n of qs[32+m]: element 160 + 16n + m
        trits[:, 48:52, :4].transpose(1, 2),  # trit n of qh[j]: element 240 + 4n + j
    )
    values = torch.cat([part.reshape(num_blocks, -1) for part in parts], dim=1)
    return values, f16_to_f32(blocks[:, 52:54])


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
            Layout.Q5_1: k_quants.q5_1,
            Layout.Q2_K: k_quants.q2_k,
            Layout.Q3_K: k_quants.q3_k,
            Layout.Q4_K: k_quants.q4_k,
            Layout.Q5_K: k_quants.q5_k,
            Layout.Q6_K: k_quants.q6_k,
            Layout.Q1_0: _q1_0,
            Layout.Q2_0: _q2_0,
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


def block_rows(weight: PackedWeight) -> torch.Tensor:
    """A block-quantized weight's file bytes as uint8 [M, row_bytes] (no copy), for the backends' repacks:
    K must be a whole number of blocks and the data exactly the rows' bytes, or InvalidModelFile."""
    num_rows, _ = weight.shape
    row_bytes = row_bytes_of(weight)  # raises for a K that is not a whole number of blocks
    if weight.data.dtype != torch.uint8 or weight.data.numel() != num_rows * row_bytes:
        raise InvalidModelFile(
            f"{weight.layout.name} tensor of shape {weight.shape} holds {weight.data.numel()} bytes",
            expected=f"{num_rows * row_bytes} bytes",
        )
    return weight.data.reshape(num_rows, row_bytes)


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
        return TernaryCodes(i2s_codes(weight), i2s_scale(weight))
    if layout is Layout.TL1:
        values = tl1_codes(weight)
        return TernaryCodes(values, tail_scale(weight.data, num_rows * num_cols // 4, "TL1"))
    if layout is Layout.TL2:
        values = tl2_codes(weight)
        return TernaryCodes(values, tail_scale(weight.data, tl2_stored_bytes(num_rows, num_cols), "TL2"))
    if layout not in (Layout.TQ1_0, Layout.TQ2_0):
        raise ValueError(f"{layout} is not a ternary file layout")
    blocks = _row_matrix(weight).reshape(-1, BLOCK_GEOMETRY[layout][1])
    values, d = _tq_values(blocks, layout)
    check_range(values, "TQ2_0 code 3 is not ternary (ggml would read it as +2)")
    values, scale = _one_live_scale(values, d.reshape(-1))
    values = values.reshape(num_rows, num_cols)
    if scale is not None:
        return TernaryCodes(values, scale)
    return TernaryCodes(values, d.reshape(num_rows, num_cols // 256).clone())


def _one_live_scale(values: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block codes int8 [N, block] and their d f32 [N] -> (the codes with d == 0 blocks zeroed, the one d
    every block holding a nonzero code shares: 0.0 when none does, None when they differ)."""
    values = values * (d != 0).to(torch.int8)[:, None]  # blocks with d == 0 decode to zeros
    live_d = d[values.any(dim=1)]
    if live_d.numel() == 0:
        return values, torch.zeros((), dtype=torch.float32, device=d.device)
    return values, live_d[0].clone() if bool((live_d == live_d[0]).all()) else None


def one_scale_ternary_codes(weight: PackedWeight) -> TernaryCodes | None:
    """A Q2_0 / Q1_0 weight as ternary codes with one scale, when it is one: every value in {-d, 0, +d}
    (no Q2_0 code 3) for a single d over the blocks that hold a nonzero value (a BitNet model written in
    llama.cpp's types, as its I2_S file's codes and scale). None otherwise: its values then need the
    per-block scales."""
    if weight.layout not in LOW_BIT_LAYOUTS:
        raise ValueError(f"{weight.layout} is not Q2_0 or Q1_0")
    num_rows, num_cols = weight.shape
    blocks = _row_matrix(weight).reshape(-1, BLOCK_GEOMETRY[weight.layout][1])
    values = low_bit_codes(blocks, weight.layout)
    if bool((values == 2).any()):  # Q2_0 code 3: +2 d
        return None
    values, scale = _one_live_scale(values, f16_to_f32(blocks[:, :2]).reshape(-1))
    return None if scale is None else TernaryCodes(values.reshape(num_rows, num_cols), scale)


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
        scale = tail_scale(weight.data, num_rows * num_cols // 4, "I2_S")
        return i2s_codes(weight, row_ids).float() * scale
    if weight.layout in (Layout.TL1, Layout.TL2):
        return dequantize(weight).index_select(0, row_ids)
    rows = _row_matrix(weight).index_select(0, row_ids)
    return _decode_rows(weight.layout, rows, num_cols)
