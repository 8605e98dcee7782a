"""The tensor-core path of the ternary linear (prefill, larger batches): int8 activations x 2-bit weights
decoded plane by plane to int8 in registers, an int32 tl.dot accumulator, split-K where the tiles are too
few to fill the SMs (see ternary_matmul.py's docstring for the numerics and the choice of path).
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.pair_epilogue import PAIR_NONE, pair_store
from bitserve.kernels.cuda.ternary_pack import GROUP


class GemmConfig(NamedTuple):
    block_t: int  # tokens per program
    block_n: int  # output rows per program
    num_warps: int
    num_stages: int
    split_k: int = 0  # programs along K per output tile; 0: chosen to fill the SMs


@triton.jit
def _epilogue(d, toks, rows, tok_ok, row_ok, s_ptr, scale_ptr, res_ptr, out_ptr, M, HAS_RES: tl.constexpr):
    """d int32 [BT, BM] -> out[toks, rows] = fl32(fl32(fl32(d) / s_act) * scale) (+ residual)."""
    s_act = tl.load(s_ptr + toks, mask=tok_ok, other=1.0)  # [BT]
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)  # [BM]
    y = tl.div_rn(d.to(tl.float32), s_act[:, None]) * scale[None, :]
    offs = toks[:, None].to(tl.int64) * M + rows[None, :]
    mask = tok_ok[:, None] & row_ok[None, :]
    if HAS_RES:
        y = y + tl.load(res_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, y, mask=mask)


# plane J of 4 packed bytes in a register, 4 instructions for 4 weights: code = (b >> 2J) & 3 per byte (the
# shift moves bits across bytes, the mask drops them), then w = code - 1 per byte with no borrow between
# bytes: ((code | 0x80) - 1) ^ 0x80
_PLANE_DECODE = (
    "and.b32 t, t, 0x03030303; or.b32 t, t, 0x80808080; "
    "sub.u32 t, t, 0x01010101; xor.b32 $0, t, 0x80808080; }"
)
_PLANE0_ASM = tl.constexpr("{ .reg .b32 t; mov.b32 t, $1; " + _PLANE_DECODE)
_PLANE1_ASM = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 2; " + _PLANE_DECODE)
_PLANE2_ASM = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 4; " + _PLANE_DECODE)
_PLANE3_ASM = tl.constexpr("{ .reg .b32 t; shr.b32 t, $1, 6; " + _PLANE_DECODE)


@triton.jit
def _swar_decode(packed, ASM: tl.constexpr):
    """uint8 [BN, 32] -> int8 [BN, 32] through one inline-asm instance per 4 bytes (pack=4)."""
    return tl.inline_asm_elementwise(ASM, "=r,r", [packed], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _decode_plane(packed, J: tl.constexpr, USE_ASM: tl.constexpr):
    """uint8 [BN, 32] packed bytes -> int8 [BN, 32]: plane J, values w = code - 1 in {-1, 0, 1}."""
    if not USE_ASM:
        return ((packed >> (2 * J)) & 3).to(tl.int8) - 1
    elif J == 0:
        return _swar_decode(packed, _PLANE0_ASM)
    elif J == 1:
        return _swar_decode(packed, _PLANE1_ASM)
    elif J == 2:
        return _swar_decode(packed, _PLANE2_ASM)
    else:
        return _swar_decode(packed, _PLANE3_ASM)


# T and the split are run-time values, not specializations: a prefill of a new length must not compile a
# kernel variant of its own in the serving path (each first-seen split cost a ~1.7 s Triton compile,
# seen as a TTFT stall of a third of a 100-request wave on an H100)
@triton.jit(do_not_specialize=["T", "SPLIT_K", "GROUPS_PER_SPLIT"])
def _gemm_kernel(
    q_ptr,  # int8 [T, K]
    w_ptr,  # uint8 [M, K // 4]
    s_ptr,  # f32 [T]
    scale_ptr,  # f32 [M]
    res_ptr,  # f32 [T, M] (read only if HAS_RES)
    out_ptr,  # f32 [T, M]
    ws_ptr,  # int32 [T * M + tiles], zeroed: split-K partial sums, then per-tile arrival counters
    T,
    M,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K,  # programs along K (run time)
    GROUPS_PER_SPLIT,  # 128-column groups per split (run time), divides K // 128
    HAS_RES: tl.constexpr,
    USE_ASM: tl.constexpr,
    PAIR: tl.constexpr,  # the pair epilogue, as _gemv_kernel's
):
    # axis 0 (fastest) walks token tiles: programs running together share one weight tile in L2
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tok_ok = toks < T
    row_ok = rows < M
    lanes = tl.arange(0, 32)
    q_rows = q_ptr + toks[:, None].to(tl.int64) * K + lanes[None, :]  # [BT, 32]
    w_rows = w_ptr + rows[:, None].to(tl.int64) * (K // 4) + lanes[None, :]  # [BN, 32]
    g_begin = tl.program_id(2) * GROUPS_PER_SPLIT
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.int32)
    for i in range(GROUPS_PER_SPLIT):
        g = g_begin + i
        packed = tl.load(w_rows + g * 32, mask=row_ok[:, None], other=0)  # uint8 [BN, 32]
        for j in tl.static_range(4):
            a = tl.load(q_rows + (g * 128 + 32 * j), mask=tok_ok[:, None], other=0)  # int8 [BT, 32]
            w = _decode_plane(packed, j, USE_ASM)  # int8 [BN, 32]: plane j, 32 contiguous columns
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
    pairs = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    if SPLIT_K == 1:
        _gemm_finish(
            acc, toks, rows, pairs, tok_ok, row_ok, s_ptr, scale_ptr, res_ptr, out_ptr, M, HAS_RES, PAIR,
            USE_ASM,
        )  # fmt: skip
    else:
        # exact int32 partial sums meet in ws (order-free); the last split to arrive runs the epilogue
        offs = toks[:, None] * M + rows[None, :]
        mask = tok_ok[:, None] & row_ok[None, :]
        tl.atomic_add(ws_ptr + offs, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's adds are issued before the release below
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        arrived = tl.atomic_add(ws_ptr + T * M + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            d = tl.load(ws_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
            _gemm_finish(
                d, toks, rows, pairs, tok_ok, row_ok, s_ptr, scale_ptr, res_ptr, out_ptr, M, HAS_RES, PAIR,
                USE_ASM,
            )  # fmt: skip


@triton.jit
def _gemm_finish(
    d, toks, rows, pairs, tok_ok, row_ok, s_ptr, scale_ptr, res_ptr, out_ptr, M, HAS_RES: tl.constexpr,
    PAIR: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """int32 D [BT, BN] of a finished tile -> the plain epilogue, or the pair epilogue (no residual)."""
    if PAIR == 0:
        _epilogue(d, toks, rows, tok_ok, row_ok, s_ptr, scale_ptr, res_ptr, out_ptr, M, HAS_RES)
    else:
        s_act = tl.load(s_ptr + toks, mask=tok_ok, other=1.0)  # [BT]
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)  # [BN]
        y = tl.div_rn(d.to(tl.float32), s_act[:, None]) * scale[None, :]
        pair_store(y, toks, tok_ok, pairs, pairs < M // 2, out_ptr, M, PAIR, USE_ASM)


def gemm_config(m: int, k: int, num_tokens: int) -> GemmConfig:
    """Tile choice of the GEMM path keyed on a bucketed T (fastest of the H100 sweep; split-K chosen to
    fill the SMs). Small token tiles win: they keep mma.sync (no shared-memory round trip of the decoded
    weights, which wgmma would need) and give many programs."""
    if num_tokens <= 16:
        return GemmConfig(block_t=16, block_n=64, num_warps=4, num_stages=3)
    if num_tokens <= 128:
        wide = k > 4096 or m > 4096
    else:
        wide = m > 8192
    return GemmConfig(block_t=32, block_n=128 if wide else 64, num_warps=4, num_stages=3)


def split_k_for(num_tiles: int, num_groups: int, target_programs: int = 264) -> int:
    """Splits along K (a divisor of num_groups, each split at least 4 groups of 128 columns) that bring
    num_tiles output tiles closest to target_programs (2 per H100 SM) without passing it."""
    best = 1
    for split in range(2, num_groups // 4 + 1):
        if num_groups % split == 0 and num_tiles * split <= target_programs:
            best = split
    return best


def launch_gemm(q, s_act, packed, scale, residual, out, cfg: GemmConfig, pair: int = PAIR_NONE) -> None:  # noqa: ANN001
    """The tensor-core path with an explicit tile config. Operands as ternary_linear's."""
    num_tokens, k = q.shape
    m = packed.shape[0]
    num_groups = k // GROUP
    tiles = (triton.cdiv(num_tokens, cfg.block_t), triton.cdiv(m, cfg.block_n))
    split = cfg.split_k or split_k_for(tiles[0] * tiles[1], num_groups)
    if num_groups % split != 0:
        raise ValueError(f"split_k {split} does not divide the {num_groups} column groups")
    per_split = num_groups // split
    # split-K workspace: int32 partial sums [T * M] and one arrival counter per tile, zeroed (one memset)
    if split > 1:
        workspace = torch.zeros(num_tokens * m + tiles[0] * tiles[1], dtype=torch.int32, device=q.device)
    else:
        workspace = out  # never read
    _gemm_kernel[(tiles[0], tiles[1], split)](
        q,
        packed,
        s_act,
        scale,
        residual if residual is not None else out,
        out,
        workspace,
        num_tokens,
        m,
        K=k,
        BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_n,
        SPLIT_K=split,
        GROUPS_PER_SPLIT=per_split,
        HAS_RES=residual is not None,
        USE_ASM=q.device.type == "cuda",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,
        PAIR=pair,
    )
