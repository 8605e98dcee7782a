"""The runtime forms of block-quantized weights on a CUDA device, and block_gemv's tile config.

Torch only (no Triton import), so the backend can prepare weights and choose paths on any machine. Every
form holds, per row (so weights stack row-wise), integer codes and f32 scales whose products are the
reference decoder's values: value = code * d + m, with d (and m) per 32 or per 16 values. Each form is
named by the file layout it was first built for (FORMS); HELD_AS says which form each file layout takes:
- Q4_1 form: nibble codes uint8 [M, K / 2] (per 32 values, low nibble value j, high nibble value j + 16,
  as Q4 files store them), d and m f32 [M, K / 32]. Q4_0 (m = -8 d), Q4_1, Q2_0 ((c - 1) d = c d - d, d per
  64 values), Q1_0 (c 2d - d, d per 128), Q4_K ((d sc_s) c - (dmin m_s) per 32-value sub-block s).
- Q2_K form: the same nibble codes with d and m per 16 values [M, K / 16]: Q2_K ((d sc) c - dmin m),
  Q3_K ((d sc) c for c in -4..3, held as (d sc)(c + 4) - 4 (d sc)).
- Q8_0 form: int8 codes [M, K], d f32 [M, K / 32]: Q8_0, Q5_0 (c - 16).
- Q5_1 form: int8 codes [M, K], d and m per 32: Q5_1, Q5_K (codes 0..31).
- Q6_K form: int8 codes [M, K], d per 16: Q6_K (code - 32, d sc per 16 values).
Every product is exact in f32 (an f16 times small integers), so each form holds the file's values.
Bytes a weight: 0.75 (Q4_1 form), 1.0 (Q2_K), 1.125 (Q8_0), 1.25 (Q5_1, Q6_K), against f32's 4.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from bitserve.kernels.cpu.blockquant import QK
from bitserve.kernels.packed import Layout
from bitserve.kernels.reference import k_quants
from bitserve.kernels.reference.dequant import BLOCK_GEOMETRY, low_bit_codes
from bitserve.kernels.reference.packed_bytes import f16_to_f32

GEMV_MAX_TOKENS = 4  # steps of more tokens run cuBLAS on the f32 copy (one grid row per token there)
MAX_TILE_VALUES = 16384  # BLOCK_M * padded K: the weight tile one program holds in registers
# BLOCK_M = 2 T (T rounded up to a power of two): the fastest tile at T = 1 and 4 on an H100 (RESULTS.md)
ROWS_PER_TOKEN = 2
WIDE_K = 2048  # a padded K from which 8 warps beat 4
HEAD_ROWS = 16384  # an LM head's rows (vocabularies): tiled for bandwidth, not latency
HEAD_TILE_VALUES = 8192
MAX_INT32_INDEX = 2**31  # the kernel indexes codes with int32 offsets (M * K values for the int8 forms)


class GemvForm(NamedTuple):
    """How a form stores its codes and scales (module docstring)."""

    nibbles: bool  # uint8 [M, K / 2] of 4-bit codes, else int8 [M, K]
    values_per_scale: int  # 32 or 16
    has_min: bool


FORMS = {
    Layout.Q4_1: GemvForm(True, 32, True),
    Layout.Q2_K: GemvForm(True, 16, True),
    Layout.Q8_0: GemvForm(False, 32, False),
    Layout.Q5_1: GemvForm(False, 32, True),
    Layout.Q6_K: GemvForm(False, 16, False),
}
HELD_AS = {
    **dict.fromkeys((Layout.Q4_0, Layout.Q4_1, Layout.Q2_0, Layout.Q1_0, Layout.Q4_K), Layout.Q4_1),
    **dict.fromkeys((Layout.Q2_K, Layout.Q3_K), Layout.Q2_K),
    **dict.fromkeys((Layout.Q8_0, Layout.Q5_0), Layout.Q8_0),
    **dict.fromkeys((Layout.Q5_1, Layout.Q5_K), Layout.Q5_1),
    Layout.Q6_K: Layout.Q6_K,
}


def _codes_and_scales(
    blocks: torch.Tensor, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """File blocks uint8 [N, type_size] -> (codes [N, values] as the form stores them, d f32 [N, S], m f32
    [N, S] or None) with S scales a block."""
    d = f16_to_f32(blocks[:, :2])  # [N, 1]: d leads the 32-value types and Q2_0 / Q1_0
    if layout is Layout.Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8), d, None
    if layout in (Layout.Q4_0, Layout.Q4_1):
        codes = k_quants.low_high(blocks[:, -QK // 2 :])
        return codes, d, f16_to_f32(blocks[:, 2:4]) if layout is Layout.Q4_1 else d * -8.0  # -8 d: exact
    if layout in (Layout.Q2_0, Layout.Q1_0):
        signed = low_bit_codes(blocks, layout)  # int8 [N, values]: Q2_0 code - 1, Q1_0 +-1
        codes = signed + 1 if layout is Layout.Q2_0 else (signed + 1) // 2
        return codes, d if layout is Layout.Q2_0 else d * 2.0, -d
    if layout in (Layout.Q5_0, Layout.Q5_1):
        codes = k_quants.five_bit_codes(blocks[:, -20:-16], blocks[:, -16:])
        if layout is Layout.Q5_0:
            return (codes.to(torch.int16) - 16).to(torch.int8), d, None
        return codes, d, f16_to_f32(blocks[:, 2:4])
    if layout in (Layout.Q4_K, Layout.Q5_K):
        codes = k_quants.q4_k_codes(blocks) if layout is Layout.Q4_K else k_quants.q5_k_codes(blocks)
        scale, minimum = k_quants.k4_scales(blocks)
        return codes, scale, minimum.neg_()
    if layout is Layout.Q2_K:
        scale, minimum = k_quants.q2_k_scales(blocks)
        return k_quants.q2_k_codes(blocks), scale, minimum.neg_()
    if layout is Layout.Q3_K:
        codes, scales = k_quants.q3_k_codes(blocks)
        scale = f16_to_f32(blocks[:, 108:110]) * scales.float()
        return codes + 4, scale, scale * -4.0  # (d sc) c = (d sc)(c + 4) - 4 (d sc), exact
    return (
        (k_quants.q6_k_codes(blocks).to(torch.int16) - 32).to(torch.int8),
        k_quants.q6_k_scales(blocks),
        None,
    )


def repack_for_gemv(
    rows: torch.Tensor, layout: Layout, num_cols: int
) -> tuple[Layout, dict[str, torch.Tensor]]:
    """A weight's file rows uint8 [M, row bytes] in a HELD_AS layout -> (its form, {"codes", "d"(, "m")}
    in that form). Copies: the file's pages may be released afterwards."""
    form_name = HELD_AS[layout]
    form = FORMS[form_name]
    num_rows = rows.shape[0]
    values, type_size = BLOCK_GEOMETRY[layout]
    codes, d, minimum = _codes_and_scales(rows.reshape(-1, type_size), layout)
    repeat = values // d.shape[1] // form.values_per_scale  # Q2_0's one d per 64 values: 2 per 32
    num_scales = num_cols // form.values_per_scale
    parts = {"d": d.repeat_interleave(repeat, dim=1).reshape(num_rows, num_scales).contiguous()}
    if form.has_min:
        parts["m"] = minimum.repeat_interleave(repeat, dim=1).reshape(num_rows, num_scales).contiguous()
    if form.nibbles:
        halves = codes.to(torch.uint8).reshape(num_rows, num_cols // QK, 2, QK // 2)
        packed = halves[:, :, 0] | (halves[:, :, 1] << 4)
        parts["codes"] = packed.reshape(num_rows, num_cols // 2).contiguous()
    else:
        parts["codes"] = codes.to(torch.int8).reshape(num_rows, num_cols).contiguous()
    return form_name, parts


def form_values(parts: dict[str, torch.Tensor], num_cols: int) -> torch.Tensor:
    """The values f32 [M, K] a form's parts hold (what block_gemv multiplies): code * d + m."""
    codes = parts["codes"]
    num_rows = codes.shape[0]
    if codes.dtype == torch.uint8:
        pairs = codes.reshape(num_rows, num_cols // QK, QK // 2)
        codes = torch.cat([pairs & 15, pairs >> 4], dim=2).reshape(num_rows, num_cols)
    per = num_cols // parts["d"].shape[1]
    values = codes.float() * parts["d"].repeat_interleave(per, dim=1)
    if "m" in parts:
        values = values + parts["m"].repeat_interleave(per, dim=1)
    return values


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
