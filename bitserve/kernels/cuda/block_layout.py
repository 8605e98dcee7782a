"""The runtime layout of Q4_0 / Q4_1 / Q8_0 weights on a CUDA device and block_gemv's tile config.

Torch only (no Triton import), so the backend can prepare weights and choose paths on any machine.
Layout: codes uint8 [M, K / 2] (Q4: each block's 16 `qs` bytes, low nibble = value j, high nibble = value
j + 16, as in the file) or int8 [M, K] (Q8_0); d f32 [M, K / 32]; for Q4, m f32 [M, K / 32] (Q4_0 is
stored as Q4_1 with m = -8 d, exact, as the CPU backend does). Per row, so weights stack row-wise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bitserve.kernels.cpu.blockquant import QK, block_field_f32
from bitserve.kernels.packed import Layout
from bitserve.kernels.reference.dequant import BLOCK_GEOMETRY, low_bit_codes
from bitserve.kernels.reference.k_quants import scale_min_k4
from bitserve.kernels.reference.packed_bytes import f16_to_f32

BLOCK_LAYOUTS = (Layout.Q4_0, Layout.Q4_1, Layout.Q8_0)  # the file layouts this form holds
GEMV_MAX_TOKENS = 4  # steps of more tokens run cuBLAS on the f32 copy (one grid row per token there)
MAX_TILE_VALUES = 16384  # BLOCK_M * padded K: the weight tile one program holds in registers
# BLOCK_M = 2 T (T rounded up to a power of two): the fastest tile at T = 1 and 4 on an H100 (RESULTS.md)
ROWS_PER_TOKEN = 2
WIDE_K = 2048  # a padded K from which 8 warps beat 4
HEAD_ROWS = 16384  # an LM head's rows (vocabularies): tiled for bandwidth, not latency
HEAD_TILE_VALUES = 8192
MAX_INT32_INDEX = 2**31  # the kernel indexes codes with int32 offsets (M * K values for Q8_0)


def repack_blocks(rows: torch.Tensor, layout: Layout, num_cols: int) -> dict[str, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q8_0 weight's file rows uint8 [M, K / 32 * type_size] -> {"codes", "d"(, "m")} in the
    kernel's layout (module docstring). Copies: the file's pages may be released afterwards."""
    num_rows, num_blocks = rows.shape[0], num_cols // QK
    type_size = BLOCK_GEOMETRY[layout][1]  # bytes per 32-value block in the file
    blocks = rows.reshape(num_rows, num_blocks, type_size)
    d = block_field_f32(rows, type_size, 0)  # [M, nb]
    if layout is Layout.Q8_0:
        codes = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(num_rows, num_cols)
        return {"codes": codes, "d": d}
    # Q4_0: m = -8 d is exact (a power-of-two multiple of an f16 value)
    minimum = block_field_f32(rows, type_size, 2) if layout is Layout.Q4_1 else d * -8.0
    codes = blocks[:, :, type_size - QK // 2 :].reshape(num_rows, num_cols // 2).clone()
    return {"codes": codes, "d": d, "m": minimum}


# File layouts whose every value is exactly code * d + m with a code < 16 and (d, m) per 32 values: held
# in the Q4 form above and run by the same GEMV. Q2_0: (c - 1) d, d per 64 values; Q1_0: c (2 d) - d, d
# per 128; Q4_K: (d sc_s) c - (dmin m_s) per 32-value sub-block s. Every product is exact in f32 (an f16
# times a small integer), so the form holds the reference decoder's values.
Q4_FORM_LAYOUTS = (Layout.Q2_0, Layout.Q1_0, Layout.Q4_K)


def repack_as_q4(rows: torch.Tensor, layout: Layout, num_cols: int) -> dict[str, torch.Tensor]:
    """A Q2_0 / Q1_0 / Q4_K weight's file rows uint8 [M, row bytes] -> {"codes", "d", "m"} of the Q4 form
    (codes uint8 [M, K / 2]: per 32 values, low nibble value j, high nibble value j + 16)."""
    num_rows = rows.shape[0]
    values, type_size = BLOCK_GEOMETRY[layout]
    blocks = rows.reshape(-1, type_size)  # [M * K / values, type_size]
    if layout is Layout.Q4_K:
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # group g: sub-block 2 g low nibbles, 2 g + 1 high
        codes = torch.cat((qs & 15, qs >> 4), dim=2).reshape(num_rows, num_cols)
        d, dmin = f16_to_f32(blocks[:, :2]), f16_to_f32(blocks[:, 2:4])  # [N, 1]
        sc, mn = scale_min_k4(blocks[:, 4:16])  # int32 [N, 8]
        scale = (d * sc.float()).reshape(num_rows, num_cols // QK)
        minimum = (dmin * mn.float()).neg_().reshape(num_rows, num_cols // QK)
    else:
        signed = low_bit_codes(blocks, layout)  # int8 [N, values]: Q2_0 code - 1, Q1_0 +-1
        codes = (signed + 1 if layout is Layout.Q2_0 else (signed + 1) // 2).to(torch.uint8)
        codes = codes.reshape(num_rows, num_cols)
        d = f16_to_f32(blocks[:, :2]).repeat_interleave(values // QK, dim=1).reshape(num_rows, num_cols // QK)
        scale = d if layout is Layout.Q2_0 else d * 2.0
        minimum = -d
    halves = codes.reshape(num_rows, num_cols // QK, 2, QK // 2)
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(num_rows, num_cols // 2)
    return {"codes": packed.contiguous(), "d": scale.contiguous(), "m": minimum.contiguous()}


class GemvTile(NamedTuple):
    """One block_gemv program: block_m output rows x nb blocks of 32 values (K padded to a power of two)."""

    block_m: int
    nb: int
    num_warps: int


def block_tile(num_rows: int, num_cols: int, num_tokens: int = 1) -> GemvTile | None:
    """The tile for an [M, K] weight at T tokens, or None when one row's padded K alone exceeds
    MAX_TILE_VALUES or M * K outgrows int32 offsets (such weights run cuBLAS on the f32 copy). A layer's
    GEMV at batch 1 is latency-bound: small row blocks (more programs, more loads in flight at once), 8
    warps from 2,048 values. An LM head (M >= HEAD_ROWS) streams tens of MB: up to 4 rows a program, 4
    warps (the sweep in RESULTS.md)."""
    nb = _next_power_of_2(num_cols // QK)
    padded = nb * QK
    if padded > MAX_TILE_VALUES or num_rows * num_cols >= MAX_INT32_INDEX:
        return None
    if num_rows >= HEAD_ROWS:
        return GemvTile(max(1, min(4, HEAD_TILE_VALUES // padded)), nb, 4)
    block_m = max(1, min(ROWS_PER_TOKEN * _next_power_of_2(num_tokens), MAX_TILE_VALUES // padded))
    return GemvTile(block_m, nb, 8 if padded >= WIDE_K else 4)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
