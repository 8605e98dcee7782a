"""Ternary linear y = fl32(fl32(fl32(D) / s_act) * scale) [+ residual] on 2-bit plane-packed weights (Triton).

D[t, m] = sum_k q[t, k] * w[m, k] is exact in int32; the epilogue divides (IEEE, tl.div_rn), multiplies
and adds as separate f32 roundings (launched with enable_fp_fusion=False: no FMA), bit-exact with
`kernels/reference/ternary.bitnet_epilogue(integer_matmul(q, w), s_act, scale)`. Packed layout: see
ternary_pack.py (byte i of a 128-column group holds columns i + 32j at bits 2j, code w + 1).

Two paths, chosen by `use_gemv` (T <= 4, or T <= GEMV_MAX_T for M <= 4096):
- GEMV (decode): weight traffic is everything, so the weights are read as int32 words (16-byte vector
  loads, evict-first) and never expanded to bytes. One word of a row holds 4 bytes = 16 weights;
  (word >> 2j) & 0x03030303 is plane j: 4 codes w + 1 of 4 contiguous columns, which one dp4a
  multiplies with the matching activation word (4 int8 of q, a 16-byte vector load per plane that
  stays in L1). D = sum(code * q) - sum(q), the per-token sum of q taken by dp4a once per program.
  That is ~3 integer instructions per weight byte. A program owns BLOCK_M rows and every token (one
  [BLOCK_M, BLOCK_W] int32 accumulator per token, reduced once at the end) and walks K in BLOCK_W-word
  chunks, unrolled; the grid is cdiv(M, BLOCK_M) small programs (1-2 warps), many waves in flight.
  When BLOCK_W >= 128 * num_warps every thread lies along K, so each thread's activation words serve
  all BLOCK_M rows.
- GEMM (prefill, larger batches): tensor cores. For each 128-column group, the packed [BLOCK_N, 32] bytes
  are loaded once (cp.async pipeline) and decoded plane by plane to int8 {-1, 0, 1} by inline PTX on
  4 bytes a register (4 instructions per 4 weights); each plane meets the contiguous activation tile
  q[:, g*128 + 32j : +32] in one int8 tl.dot with an int32 accumulator, four dots per group. Token tiles
  of 16-32 keep mma.sync, whose B operand Triton decodes straight from shared memory into registers
  (wgmma would need the decoded weights written back to shared memory). When the tiles are too few
  to fill the SMs, K is split: partial int32 sums meet exactly by atomic adds in a zeroed workspace
  (one memset) and the last split to arrive runs the epilogue. Tile sizes come from a fixed table
  keyed on a bucketed T (no autotuning: deterministic per shape, so CUDA-graph capture is safe).
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.pair_epilogue import PAIR_NONE, out_width, pair_store
from bitserve.kernels.cuda.pdl import launch_options, pdl_enter
from bitserve.kernels.cuda.ternary_gemm import gemm_config, launch_gemm
from bitserve.kernels.cuda.ternary_pack import GROUP
from bitserve.kernels.tuning import GemvOverrides

GEMV_MAX_T = 8  # largest T served by the dp4a GEMV path
# NOTE: the GEMV's last KW % BLOCK_W words run as a chunk of their own (next power of two wide: gemv_tail)
# instead of a whole masked BLOCK_W chunk: at the 2B's K = 2560 (KW 160) a 128-word chunk pair spent 96 of
# its 256 words' instructions on masked zeros, 29% of the step's GEMV work over its four projections (sm_90
# SASS, compiled offline: RESULTS.md); 2B batch-1 decode on an H200 1.040 -> 1.025 ms a step (2026-11-28).
WORDS_PER_GROUP = tl.constexpr(GROUP // 16)  # int32 words of packed weights per 128-column group (8)


class GemvConfig(NamedTuple):
    block_m: int  # rows per program
    block_w: int  # packed int32 words per row and chunk (16 weights each)
    num_warps: int


INTERPRETER_GEMV = GemvConfig(block_m=64, block_w=128, num_warps=1)  # few, large programs: CPU time


@triton.jit
def dp4a(a, b, c, USE_ASM: tl.constexpr):
    """c + sum over the 4 bytes of a * b (signed bytes; int32 words, same shapes)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        # the CPU interpreter has no inline asm: sign-extend each byte and multiply
        acc = c
        for i in tl.static_range(4):
            acc += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return acc


@triton.jit
def _gemv_row_epilogue(d, t, rows, row_ok, s_act, scale, residual, out_ptr, M, HAS_RES: tl.constexpr):
    """d int32 [BM] of token t -> out[t, rows] = fl32(fl32(fl32(d) / s_act) * scale) (+ residual): the
    operands already loaded (scale f32 [BM], residual f32 [BM] when HAS_RES, s_act a scalar)."""
    y = tl.div_rn(d.to(tl.float32), s_act) * scale
    if HAS_RES:
        y = y + residual
    tl.store(out_ptr + t * M + rows, y, mask=row_ok)


@triton.jit
def _token_sum(q_row_ptr, QW: tl.constexpr, SUM_BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    """sum_k q[t, k] of one token row read as QW int32 words: an int32 scalar."""
    offs = tl.arange(0, SUM_BLOCK)
    ones = tl.full([SUM_BLOCK], 0x01010101, tl.int32)
    total = tl.zeros([SUM_BLOCK], tl.int32)
    for c in tl.static_range(0, QW, SUM_BLOCK):
        a = tl.load(q_row_ptr + c + offs, mask=c + offs < QW, other=0)
        total = dp4a(a, ones, total, USE_ASM)
    return tl.sum(total, axis=0)


@triton.jit
def _gemv_kernel(
    q_ptr,  # int32 [T, K // 4]: q's int8 bytes read as words
    w_ptr,  # int32 [M, K // 16]: the packed planes read as words
    s_ptr,  # f32 [T]
    scale_ptr,  # f32 [M]
    res_ptr,  # f32 [T, M] (read only if HAS_RES)
    out_ptr,  # f32 [T, M]
    M,
    KW: tl.constexpr,  # K // 16
    NUM_T: tl.constexpr,  # T: one accumulator per token, all unrolled
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SUM_BLOCK: tl.constexpr,  # activation words per step of the token-sum epilogue
    EVEN_M: tl.constexpr,  # M % BLOCK_M == 0: no row masks
    A_1D: tl.constexpr,  # BLOCK_W >= 128 * num_warps: all threads lie along K
    HAS_RES: tl.constexpr,
    USE_ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
    PAIR: tl.constexpr,  # the pair epilogue (pair_epilogue.py): PAIR_NONE, or the gated activation's
    TAIL_W: tl.constexpr = 0,  # > 0: the last KW % BLOCK_W words as one chunk this wide (see gemv_tail)
    TAIL_A_1D: tl.constexpr = False,  # the tail chunk's A_1D
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    QW: tl.constexpr = KW * 4  # activation words per token
    MAIN_END: tl.constexpr = KW if TAIL_W == 0 else KW // BLOCK_W * BLOCK_W  # words in BLOCK_W chunks
    w_rows = w_ptr + rows[:, None].to(tl.int64) * KW  # [BM, 1]
    # every weight load of the program is issued first: the DRAM latency is paid once, not per chunk
    chunks = _load_weight_chunks(w_rows, row_ok, KW, 0, MAIN_END, BLOCK_W, EVEN_M)
    tail = ()
    if TAIL_W > 0:
        tail = _load_weight_chunks(w_rows, row_ok, KW, MAIN_END, MAIN_END + TAIL_W, TAIL_W, EVEN_M)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)  # [BM]: a weight, not an input
    # with PDL the loads above overlap the previous kernel; q, s_act, residual are its outputs
    pdl_enter(USE_PDL)
    # the epilogue's inputs are asked for now, so their L2 round trips run under the weights' DRAM
    # latency instead of after the dot products (each was a serial ~0.5 µs at the kernel's tail)
    q_sums, s_acts, residuals = _epilogue_inputs(
        q_ptr, s_ptr, res_ptr, rows, row_ok, scale, M, QW, NUM_T, SUM_BLOCK, HAS_RES, USE_ASM
    )
    accs = _zero_accumulators(NUM_T, BLOCK_M, BLOCK_W)
    tail_accs = ()
    if TAIL_W > 0:
        tail_accs = _zero_accumulators(NUM_T, BLOCK_M, TAIL_W)
    for c in tl.static_range(0, MAIN_END, BLOCK_W):
        accs = _gemv_chunk(chunks[c // BLOCK_W], c, accs, q_ptr, rows, KW, NUM_T, BLOCK_W, A_1D, USE_ASM)
    if TAIL_W > 0:
        tail_accs = _gemv_chunk(
            tail[0], MAIN_END, tail_accs, q_ptr, rows, KW, NUM_T, TAIL_W, TAIL_A_1D, USE_ASM
        )
    _gemv_store(accs, tail_accs, q_sums, s_acts, residuals, scale, rows, row_ok, out_ptr, M, NUM_T, BLOCK_M,
                TAIL_W, PAIR, HAS_RES, USE_ASM)  # fmt: skip


@triton.jit
def _epilogue_inputs(
    q_ptr, s_ptr, res_ptr, rows, row_ok, scale, M, QW: tl.constexpr, NUM_T: tl.constexpr,
    SUM_BLOCK: tl.constexpr, HAS_RES: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """Per token: sum(q) (int32), s_act (f32) and the residual row [BM] (the scale as a placeholder when
    there is none, never read): three NUM_T-tuples."""
    q_sums = ()
    s_acts = ()
    residuals = ()
    for t in tl.static_range(NUM_T):
        q_sums = q_sums + (_token_sum(q_ptr + t * QW, QW, SUM_BLOCK, USE_ASM),)
        s_acts = s_acts + (tl.load(s_ptr + t),)
        if HAS_RES:
            residuals = residuals + (tl.load(res_ptr + t * M + rows, mask=row_ok, other=0.0),)
        else:
            residuals = residuals + (scale,)
    return q_sums, s_acts, residuals


@triton.jit
def _zero_accumulators(NUM_T: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """NUM_T int32 [BM, WIDTH] zero accumulators, one per token.

    NOTE: a tuple of 2-D accumulators, not a 3-D tensor: Triton gives a loop-carried 3-D accumulator a
    layout of its own and converts every weight tile to it through shared memory."""
    accs = ()
    for _ in tl.static_range(NUM_T):
        accs = accs + (tl.zeros([BLOCK_M, WIDTH], tl.int32),)
    return accs


@triton.jit
def _gemv_store(
    accs, tail_accs, q_sums, s_acts, residuals, scale, rows, row_ok, out_ptr, M, NUM_T: tl.constexpr,
    BLOCK_M: tl.constexpr, TAIL_W: tl.constexpr, PAIR: tl.constexpr, HAS_RES: tl.constexpr,
    USE_ASM: tl.constexpr,
):  # fmt: skip
    """Each token's D = sum(code * q) - sum(q) (code = w + 1), through the row epilogue or the pair one."""
    for t in tl.static_range(NUM_T):
        d = tl.sum(accs[t], axis=1) - q_sums[t]  # [BM]
        if TAIL_W > 0:
            d += tl.sum(tail_accs[t], axis=1)
        if PAIR == 0:
            _gemv_row_epilogue(d, t, rows, row_ok, s_acts[t], scale, residuals[t], out_ptr, M, HAS_RES)
        else:
            # (pairs only here: a 1-row tile, which only a pair-free test config uses, has none)
            pairs = tl.program_id(0) * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
            y = tl.div_rn(d.to(tl.float32), s_acts[t]) * scale
            tok = tl.full([1], t, tl.int32)
            pair_store(y[None, :], tok, tok >= 0, pairs, pairs < M // 2, out_ptr, M, PAIR, USE_ASM)


@triton.jit
def _load_weight_chunks(
    w_rows, row_ok, KW: tl.constexpr, START: tl.constexpr, END: tl.constexpr, BLOCK_W: tl.constexpr,
    EVEN_M: tl.constexpr,
):  # fmt: skip
    """The [BM, BW] int32 weight chunks of the program's rows from word START up to END, as a tuple
    (masked only at the edges; none when END <= START)."""
    cols = tl.arange(0, BLOCK_W)
    chunks = ()
    for c in tl.static_range(START, END, BLOCK_W):
        kw = c + cols
        # weights are read once: stream them past L1, which keeps the activations
        if EVEN_M and c + BLOCK_W <= KW:
            w = tl.load(w_rows + kw[None, :], eviction_policy="evict_first")
        else:
            mask = row_ok[:, None] & (kw < KW)[None, :]
            w = tl.load(w_rows + kw[None, :], mask=mask, other=0, eviction_policy="evict_first")
        chunks = chunks + (w,)
    return chunks


@triton.jit
def _gemv_chunk(
    w,  # int32 [BM, BW]: words c .. c + BW of the program's weight rows
    c: tl.constexpr,
    accs,  # NUM_T int32 [BM, BW] accumulators
    q_ptr,
    rows,
    KW: tl.constexpr,
    NUM_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    A_1D: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """accs[t] += code * q per word for the 4 planes of one weight chunk; returns the new accs."""
    kw = c + tl.arange(0, BLOCK_W)  # [BW] weight word of each lane
    # word u of group g, plane j meets activation word g * 32 + 8j + u
    a_word = kw + (kw // WORDS_PER_GROUP) * (3 * WORDS_PER_GROUP)
    a_rows = rows[:, None] * 0  # [BM, 1] zeros: gives the activation loads the weights' 2-D shape
    a_mask = (rows >= 0)[:, None] & (kw < KW)[None, :]
    for j in tl.static_range(4):
        codes = (w >> (2 * j)) & 0x03030303  # [BM, BW]: 4 codes w + 1 per word
        new_accs = ()
        for t in tl.static_range(NUM_T):
            a_ptrs = q_ptr + (a_word + (t * KW * 4 + WORDS_PER_GROUP * j))  # [BW]
            if A_1D:
                # every thread along K: the [BW] load has the weights' column layout, and each
                # thread reuses its activation words for all BLOCK_M rows
                a = tl.load(a_ptrs, mask=kw < KW, other=0)[None, :]
            elif c + BLOCK_W <= KW:
                # NOTE: a [BM, BW] load of rows that repeat one address: a [BW] load would get a
                # layout of its own here (one word a thread) and a shared-memory conversion
                a = tl.load(a_ptrs[None, :] + a_rows)
            else:
                a = tl.load(a_ptrs[None, :] + a_rows, mask=a_mask, other=0)
            new_accs = new_accs + (dp4a(codes, a, accs[t], USE_ASM),)
        accs = new_accs
    return accs


def use_gemv(m: int, k: int, num_tokens: int) -> bool:
    """The dp4a GEMV path up to T = 4, and up to T = GEMV_MAX_T for matrices of at most 4096 rows; the
    tensor-core path beyond (H100: GEMV T = 8 vs GEMM T = 16 is 7.1 vs 7.4 µs at 2560x2560, 23 vs 13 µs
    at 13824x2560)."""
    return num_tokens <= 4 or (num_tokens <= GEMV_MAX_T and m <= 4096)


def gemv_config(m: int, k: int, num_tokens: int, overrides: GemvOverrides | None = None) -> GemvConfig:
    """Tile choice of the GEMV path: the fastest of benchmarks/bench_cuda_kernels.py --sweep on H100.

    Small programs of 2-8 rows and 128-256-word (2048-4096-weight) chunks, one or two warps: many small
    programs in flight hide DRAM latency best. The 13824-row gate/up matrix prefers more rows a program.
    `overrides` ((M, K, T) -> (block_m, block_w, num_warps): KernelTuning.cuda_gemv_tiles, for sweeps inside
    the decode chain, where a GEMV's weights arrive under the kernel before it and its instruction count,
    not its standalone latency, is what the step pays) come first.
    """
    override = None if overrides is None else overrides.get((m, k, num_tokens))
    if override is not None:
        return GemvConfig(*override)
    if m >= 8192:
        if num_tokens == 1:
            return GemvConfig(block_m=16, block_w=64, num_warps=4)
        return GemvConfig(block_m=8, block_w=64 if num_tokens == 2 else 128, num_warps=1)
    if num_tokens == 1:
        return GemvConfig(block_m=4 if m >= 3072 else 2, block_w=128, num_warps=1)
    if k > 4096 and num_tokens <= 4:
        return GemvConfig(block_m=4, block_w=256, num_warps=2)
    return GemvConfig(block_m=2 if num_tokens == 2 else 4, block_w=128, num_warps=1)


def _check_operands(
    q: torch.Tensor,
    s_act: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    out_cols: int | None = None,
) -> tuple[int, int, int]:
    """Dtype/shape/contiguity checks (metadata only, no host sync). Returns (T, M, K)."""
    if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous int8 [T, K], got {q.dtype} {tuple(q.shape)}")
    num_tokens, k = q.shape
    if k == 0 or k % GROUP != 0:
        raise ValueError(f"K must be a positive multiple of {GROUP}, got {k}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
        raise ValueError(
            f"packed must be contiguous uint8 [M, K // 4], got {packed.dtype} {tuple(packed.shape)}"
        )
    m = packed.shape[0]
    if packed.shape[1] != k // 4:
        raise ValueError(f"packed width {packed.shape[1]} does not match K = {k} (need {k // 4})")
    if s_act.dtype != torch.float32 or s_act.shape != (num_tokens,) or not s_act.is_contiguous():
        raise ValueError(
            f"s_act must be contiguous f32 [{num_tokens}], got {s_act.dtype} {tuple(s_act.shape)}"
        )
    if scale.dtype != torch.float32 or scale.shape != (m,) or not scale.is_contiguous():
        raise ValueError(
            f"scale must be contiguous f32 [{m}] (one per row), got {scale.dtype} {tuple(scale.shape)}"
        )
    for name, t, width in (("residual", residual, m), ("out", out, out_cols or m)):
        if t is not None and (
            t.dtype != torch.float32 or t.shape != (num_tokens, width) or not t.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be contiguous f32 [{num_tokens}, {width}], got {t.dtype} {tuple(t.shape)}"
            )
    devices = {t.device for t in (q, s_act, packed, scale, residual, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    return num_tokens, m, k


def launch_gemv(q, s_act, packed, scale, residual, out, cfg: GemvConfig, pair: int = PAIR_NONE) -> None:  # noqa: ANN001
    """The dp4a path with an explicit tile config (T <= GEMV_MAX_T). Operands as ternary_linear's."""
    num_tokens, k = q.shape
    m = packed.shape[0]
    if pair != PAIR_NONE and cfg.block_m % 2:
        raise ValueError(f"a pair epilogue needs an even block_m, got {cfg.block_m}")
    _gemv_kernel[(triton.cdiv(m, cfg.block_m),)](
        q.view(torch.int32),  # [T, K // 4]
        packed.view(torch.int32),  # [M, K // 16]
        s_act,
        scale,
        residual if residual is not None else out,
        out,
        m,
        **gemv_constexprs(m, k, num_tokens, cfg, pair, residual is not None, q.device.type == "cuda"),
        num_warps=cfg.num_warps,
        enable_fp_fusion=False,
        **launch_options(q.device),
    )


def gemv_constexprs(
    m: int, k: int, num_tokens: int, cfg: GemvConfig, pair: int, has_residual: bool, use_asm: bool
) -> dict[str, int | bool]:
    """The GEMV kernel's compile-time arguments (all but USE_PDL) for an M x K weight at T tokens: what
    launch_gemv passes, and what benchmarks/sass_count_gemv.py compiles offline."""
    kw = k // 16
    tail_w = gemv_tail(kw, cfg.block_w)
    return {
        "KW": kw, "NUM_T": num_tokens, "BLOCK_M": cfg.block_m, "BLOCK_W": cfg.block_w,
        "SUM_BLOCK": min(256, triton.next_power_of_2(k // 4)), "EVEN_M": m % cfg.block_m == 0,
        "A_1D": _all_threads_along_k(cfg.block_w, cfg.num_warps), "HAS_RES": has_residual,
        "USE_ASM": use_asm, "PAIR": pair, "TAIL_W": tail_w,
        "TAIL_A_1D": _all_threads_along_k(tail_w, cfg.num_warps),
    }  # fmt: skip


def _all_threads_along_k(words: int, num_warps: int) -> bool:
    """A chunk this many words wide gives every thread of the program its own 4-word slice along K."""
    return words >= 128 * num_warps


def gemv_tail(kw: int, block_w: int) -> int:
    """Width of the GEMV's tail chunk for KW words a row in BLOCK_W chunks: the next power of two of the
    remainder, 0 when the chunks divide KW."""
    rest = kw % block_w
    return triton.next_power_of_2(rest) if rest else 0


def ternary_linear(
    q: torch.Tensor,
    s_act: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pair: int = PAIR_NONE,
    gemv_overrides: GemvOverrides | None = None,
) -> torch.Tensor:
    """q int8 [T, K], s_act f32 [T], packed uint8 [M, K // 4], scale f32 [M] -> f32 [T, M].

    y[t, m] = fl32(fl32(fl32(D[t, m]) / s_act[t]) * scale[m]) (+ residual[t, m], one f32 add).
    With a gated `pair` (a GATED_PAIRS code, on a weight whose rows gated_row_order interleaved)
    the epilogue writes act(gate) * up instead: out f32 [T, M / 2], no residual (pair_epilogue.py).
    All operands contiguous on one device; `out`, when given, is written in place and returned.
    No host sync (CUDA-graph capturable once each (T, M, K) has been run once). gemv_overrides: tiles
    replacing gemv_config's choice by shape (KernelTuning.gemv_overrides).
    """
    width = out_width(pair, packed.shape[0])
    if pair != PAIR_NONE and residual is not None:
        raise ValueError("a pair epilogue takes no residual")
    num_tokens, m, k = _check_operands(q, s_act, packed, scale, residual, out, width)
    if out is None:
        out = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or m == 0:
        return out
    if use_gemv(m, k, num_tokens):
        cfg = gemv_config(m, k, num_tokens, gemv_overrides) if q.is_cuda else INTERPRETER_GEMV
        launch_gemv(q, s_act, packed, scale, residual, out, cfg, pair)
    else:
        launch_gemm(q, s_act, packed, scale, residual, out, gemm_config(m, k, num_tokens), pair)
    return out
