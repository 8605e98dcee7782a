"""Block-quantized GEMV for decode steps of a few tokens, dequantizing in registers (every block layout
block_layout.HELD_AS names: Q4_0 / Q4_1 / Q8_0, Q5_*, Q2_0 / Q1_0 and the K-quants).

Why: at batch 1 a SmolLM2-sized layer is a chain of ~2-6 µs kernels. Its dense projections ran as cuBLAS
f32 GEMVs on weights dequantized at load (6.4x the Q4_1 bytes), behind a separate RMSNorm launch and,
before Wdown, a separate activation launch; cuBLAS kernels also never start early under programmatic
dependent launch (pdl.py), so each one paid a full launch and drain. This kernel reads the packed blocks
(Q4_1: 24 bytes per 32 weights in this layout, against 128 as f32), applies the RMSNorm and / or the
gated activation to x in its prologue and adds the residual in its epilogue: one PDL launch per
projection.

Weights in one of block_layout.py's forms: nibble or int8 codes, d (and m) f32 per 32 or per 16 values; a
block's two halves of 16 values each take their own scale in the per-16 forms (the K-quants' sub-blocks).

One program owns BLOCK_M output rows and the whole K (padded to a power of two) for every token of the
step: its weight tile (two [BLOCK_M, NB, 16] halves) and norm weight are loaded once, before the PDL
wait, and each token's x after it.

Numerics: the prologue is elementwise.py's, op for op (RMSNorm: f64 sum of squares, inv_rms = 1 /
sqrt(fl32(ms) + eps), (x * inv_rms) * w; activation: act(gate) * up), so the normalized input is the one
the separate kernels produced. The weights are dequantized in registers as d q + m (Q8_0: d q; the
compiler may fuse it into one FMA) and the dot sums in f32 in the tile's order, not F.linear's: agreement
within fp32 summation-order error, as the CPU backend's block kernels (kernels/cpu/blockquant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.block_layout import GEMV_MAX_TOKENS, GemvTile, block_tile
from bitserve.kernels.cuda.elementwise import ACTIVATIONS, activate, inv_rms
from bitserve.kernels.cuda.pdl import launch_options, pdl_enter

NO_ACTIVATION = -1  # ACT of an ungated input (ACTIVATIONS' codes are >= 0)


@triton.jit
def _gated_input(x_row, cols, mask, num_cols, ACT: tl.constexpr):
    """x[cols] f32, or act(gate[cols]) * up[cols] with the up half at num_cols (elementwise.activate, as
    the separate kernel computes it)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if ACT >= 0:
        x = activate(x, ACT) * tl.load(x_row + num_cols + cols, mask=mask, other=0.0)
    return x


@triton.jit
def _half_scales(ptr, field, mask, PER_16: tl.constexpr):
    """The scales (or mins) of each block's first and last 16 values, [BLOCK_M, NB, 1] each: one per block
    (field: the block's index), or one per half at 2 field and 2 field + 1 in the per-16 forms."""
    if PER_16:
        low = tl.load(ptr + 2 * field, mask=mask, other=0.0)
        high = tl.load(ptr + 2 * field + 1, mask=mask, other=0.0)
        return low[:, :, None], high[:, :, None]
    both = tl.load(ptr + field, mask=mask, other=0.0)[:, :, None]
    return both, both


@triton.jit
def _block_gemv_kernel(
    x_ptr, codes_ptr, d_ptr, m_ptr, norm_ptr, res_ptr, out_ptr,
    num_rows, num_cols, x_stride, res_stride, out_stride, eps,
    IS_Q4: tl.constexpr, HAS_MIN: tl.constexpr, PER_16: tl.constexpr, HAS_NORM: tl.constexpr,
    ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NUM_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
    NB: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # a block's 32 values as two halves of 16: Q4's low / high nibbles of its 16 bytes, Q8's two runs
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    blocks = tl.arange(0, NB)  # [NB]
    lanes = tl.arange(0, 16)  # [16]
    num_blocks = num_cols // 32
    block_mask = (rows[:, None] < num_rows) & (blocks[None, :] < num_blocks)  # [BLOCK_M, NB]
    tile_mask = block_mask[:, :, None]  # [BLOCK_M, NB, 1]
    field = rows[:, None] * num_blocks + blocks[None, :]  # [BLOCK_M, NB]: index into d / m per 32
    d_lo, d_hi = _half_scales(d_ptr, field, block_mask, PER_16)  # [BLOCK_M, NB, 1] each
    cols_lo = blocks[:, None] * 32 + lanes[None, :]  # [NB, 16]: values 0-15 of each block; +16: 16-31
    col_mask = cols_lo < num_cols
    # the weights dequantized in registers as the reference does (d q + m; Q8_0: d q), before the wait:
    # only weights are read, so this overlaps the previous kernel
    if IS_Q4:
        byte = rows[:, None, None] * (num_cols // 2) + (blocks[:, None] * 16 + lanes[None, :])[None, :, :]
        packed = tl.load(codes_ptr + byte, mask=tile_mask, other=0)  # uint8 [BLOCK_M, NB, 16]
        w_lo = d_lo * (packed & 15).to(tl.float32)  # f32 [BLOCK_M, NB, 16]
        w_hi = d_hi * (packed >> 4).to(tl.float32)
    else:
        index = rows[:, None, None] * num_cols + cols_lo[None, :, :]
        w_lo = d_lo * tl.load(codes_ptr + index, mask=tile_mask, other=0).to(tl.float32)
        w_hi = d_hi * tl.load(codes_ptr + index + 16, mask=tile_mask, other=0).to(tl.float32)
    if HAS_MIN:
        m_lo, m_hi = _half_scales(m_ptr, field, block_mask, PER_16)
        w_lo = w_lo + m_lo
        w_hi = w_hi + m_hi
    if HAS_NORM:  # a weight: read before the wait
        norm_lo = tl.load(norm_ptr + cols_lo, mask=col_mask, other=0.0)
        norm_hi = tl.load(norm_ptr + cols_lo + 16, mask=col_mask, other=0.0)
    pdl_enter(USE_PDL)
    row_mask = rows < num_rows
    for token in tl.static_range(NUM_TOKENS):  # the weight tile serves every token of the step
        x_row = x_ptr + token * x_stride
        x_lo = _gated_input(x_row, cols_lo, col_mask, num_cols, ACT)  # f32 [NB, 16]
        x_hi = _gated_input(x_row, cols_lo + 16, col_mask, num_cols, ACT)
        if HAS_NORM:  # as elementwise._rms_norm_kernel
            wide_lo, wide_hi = x_lo.to(tl.float64), x_hi.to(tl.float64)
            squares = tl.sum(tl.sum(wide_lo * wide_lo, axis=1) + tl.sum(wide_hi * wide_hi, axis=1), axis=0)
            scale = inv_rms(squares, num_cols, eps)
            x_lo = (x_lo * scale) * norm_lo
            x_hi = (x_hi * scale) * norm_hi
        products = w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :]  # [BLOCK_M, NB, 16]
        y = tl.sum(tl.sum(products, axis=2), axis=1)  # [BLOCK_M]
        if HAS_RESIDUAL:
            y = tl.load(res_ptr + token * res_stride + rows, mask=row_mask, other=0.0) + y
        tl.store(out_ptr + token * out_stride + rows, y, mask=row_mask)


def block_gemv(
    x: torch.Tensor,
    weight: dict[str, torch.Tensor],
    num_rows: int,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    tile: GemvTile | None = None,
) -> torch.Tensor:
    """residual + W @ norm(act(x)) for T <= GEMV_MAX_TOKENS tokens.

    x f32 [T, K] (under `activation`, [T, 2K]: gate columns then up), unit column stride; weight the parts
    of block_layout.repack_for_gemv for an [num_rows, K] matrix; norm_weight f32 [K]; residual f32 [T, M]
    -> f32 [T, M]. tile: block_tile's choice unless given (benchmarks sweep it).
    """
    num_tokens = x.shape[0]
    num_cols = x.shape[1] // 2 if activation is not None else x.shape[1]
    tile = tile or block_tile(num_rows, num_cols, num_tokens)
    if tile is None or num_tokens > GEMV_MAX_TOKENS or x.stride(1) != 1:
        raise ValueError(f"block_gemv: {num_tokens} tokens of K={num_cols} is outside the kernel's range")
    codes, d = weight["codes"], weight["d"]
    is_q4 = codes.dtype == torch.uint8
    per_16 = d.shape[1] * 16 == num_cols  # the K-quant forms' scales per 16 values
    out = torch.empty((num_tokens, num_rows), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    act = NO_ACTIVATION if activation is None else ACTIVATIONS[activation]
    grid = (triton.cdiv(num_rows, tile.block_m),)
    _block_gemv_kernel[grid](
        x, codes, d, weight.get("m", d), d if norm_weight is None else norm_weight,
        out if residual is None else residual, out,
        num_rows, num_cols, x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), eps,
        IS_Q4=is_q4, HAS_MIN="m" in weight, PER_16=per_16, HAS_NORM=norm_weight is not None, ACT=act,
        HAS_RESIDUAL=residual is not None,
        NUM_TOKENS=num_tokens, BLOCK_M=tile.block_m, NB=tile.nb, num_warps=tile.num_warps,
        **launch_options(x.device),
    )  # fmt: skip
    return out
