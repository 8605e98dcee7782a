"""Fused [gated activation ->] [RMSNorm ->] per-token absmax int8 quantization (Triton), bit-exact with
`layers/activation.py`, `layers/norm.py` and `kernels/reference/ternary.quantize_activations`.

One program per token row. A row of up to MAX_SINGLE_BLOCK values after the activation is held in
registers and read from memory once; a wider row takes three passes over BLOCK-wide chunks (sum of
squares, absmax, quantize), re-reading the row from L1/L2. Numerics, step by step:
  relu2: h = fl32(fl32(r * r) * u), r = max(g, 0)    (torch.relu(gate).square() * up)
  silu:  h = fl32(fl32(g / fl32(1 + exp(-g))) * u)   (torch's x / (1 + exp(-x)); exp may differ by an ulp)
  norm:  ms = f64 sum of f64 squares / K; inv = fl32(1 / fl32(sqrt(fl32(ms) + eps))) with IEEE sqrt and
         division; y = fl32(fl32(h * inv) * w)
  quant: amax = max(|y|) (exact in f32), s = fl32(127 / max(f64(amax), 1e-5)) divided in f64,
         q = clamp(rne(fl32(y * s)), -128, 127)
Kernels are launched with enable_fp_fusion=False: no multiply may fuse into an add (FMA) here.
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from bitserve.kernels.cuda.elementwise import inv_rms
from bitserve.kernels.cuda.pdl import launch_options, pdl_enter

AMAX_FLOOR = 1e-5  # as kernels/reference/ternary.AMAX_FLOOR (docs/formats.md §3.1)
MAX_SINGLE_BLOCK = 8192  # widest post-activation row kept in registers (BitNet 2B-4T: 6912)
CHUNK = 2048  # chunk width of the three-pass path
ACTIVATIONS = {None: 0, "relu2": 1, "relu_sqr": 1, "silu": 2}
# a row block's width -> warps of a row's program (narrower blocks: 4). At T = 1 on an H200 half or twice
# these warps moved the 2B decode step within its noise (RESULTS.md, 2026-11-29 10:25)
NORM_QUANTIZE_WARPS: dict[int, int] = {8192: 16, 4096: 8, 2048: 8}
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: fl32(v + M) - M is rne(v) for |v| < 2^22


@triton.jit
def _load_act(row_ptr, offs, mask, K: tl.constexpr, ACT: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """The row's values at offs (f32, 0 where masked): x itself, or act(gate) * up of a [2K] row."""
    h = tl.load(row_ptr + offs, mask=mask, other=0.0)
    if ACT != 0:
        h = gated_product(h, tl.load(row_ptr + K + offs, mask=mask, other=0.0), ACT, USE_LIBDEVICE)
    return h


@triton.jit
def gated_product(g, u, ACT: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """act(g) * u in this module's arithmetic (docstring): ACT 1 relu2, 2 silu (ACTIVATIONS' codes)."""
    if ACT == 1:
        r = tl.maximum(g, 0.0)
        h = (r * r) * u
    else:
        if USE_LIBDEVICE:
            e = libdevice.exp(-g)  # accurate expf, not the ex2.approx of tl.exp
        else:
            e = tl.exp(-g)
        h = tl.div_rn(g, 1.0 + e) * u
    return h


@triton.jit
def _act_scale(amax):
    """f32 absmax of a row -> s_act = fl32(127 / max(f64(amax), 1e-5)), divided in f64."""
    amax64 = tl.maximum(amax.to(tl.float64), 1e-5)
    return (127.0 / amax64).to(tl.float32)


@triton.jit
def _quantize(y, s, USE_LIBDEVICE: tl.constexpr):
    """f32 values, f32 scale -> int8 clamp(rne(fl32(y * s)), -128, 127)."""
    p = y * s
    if USE_LIBDEVICE:
        r = libdevice.rint(p)
    else:
        # |p| <= 127 (1 + 2^-23): the magic-number add rounds half to even and the subtract is exact
        r = (p + RNE_MAGIC) - RNE_MAGIC
    r = tl.minimum(tl.maximum(r, -128.0), 127.0)
    return r.to(tl.int32).to(tl.int8)


@triton.jit
def _norm_quantize_kernel(
    x_ptr,  # f32 [T, K] or [T, 2K] (gated)
    w_ptr,  # f32 [K] norm weight (unused unless HAS_NORM)
    q_ptr,  # int8 [T, K]
    s_ptr,  # f32 [T]
    eps,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * (2 * K if ACT != 0 else K)
    q_row = q_ptr + row * K
    offs = tl.arange(0, BLOCK)
    if BLOCK >= K and HAS_NORM:
        # a weight, no kernel's output: read before the PDL wait, under the previous kernel (it came from
        # DRAM after the wait: 2B batch-1 graph replay 1.186 -> 1.116 ms on an H100)
        w = tl.load(w_ptr + offs, mask=offs < K, other=0.0)
    else:
        w = offs  # a placeholder, never read
    pdl_enter(USE_PDL)
    if BLOCK >= K:
        # the whole row in registers: one read of x
        mask = offs < K
        h = _load_act(x_row, offs, mask, K, ACT, USE_LIBDEVICE)
        if HAS_NORM:
            h64 = h.to(tl.float64)
            inv = inv_rms(tl.sum(h64 * h64, axis=0), K, eps)
            h = (h * inv) * w
        s = _act_scale(tl.max(tl.abs(h), axis=0))
        tl.store(q_row + offs, _quantize(h, s, USE_LIBDEVICE), mask=mask)
    else:
        # three passes over BLOCK-wide chunks; the row is re-read from cache
        inv = 1.0
        if HAS_NORM:
            sum_sq = tl.zeros([BLOCK], tl.float64)
            for k0 in range(0, K, BLOCK):
                mask = k0 + offs < K
                h64 = _load_act(x_row, k0 + offs, mask, K, ACT, USE_LIBDEVICE).to(tl.float64)
                sum_sq += h64 * h64
            inv = inv_rms(tl.sum(sum_sq, axis=0), K, eps)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            h = _load_act(x_row, k0 + offs, mask, K, ACT, USE_LIBDEVICE)
            if HAS_NORM:
                h = (h * inv) * tl.load(w_ptr + k0 + offs, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(h))
        s = _act_scale(tl.max(amax, axis=0))
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            h = _load_act(x_row, k0 + offs, mask, K, ACT, USE_LIBDEVICE)
            if HAS_NORM:
                h = (h * inv) * tl.load(w_ptr + k0 + offs, mask=mask, other=0.0)
            tl.store(q_row + k0 + offs, _quantize(h, s, USE_LIBDEVICE), mask=mask)
    tl.store(s_ptr + row, s)


def _check_inputs(
    x: torch.Tensor, norm_weight: torch.Tensor | None, activation: str | None
) -> tuple[int, int]:
    """Shape/dtype checks (metadata only: no host sync). Returns (T, K), K the quantized width."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(str(a) for a in ACTIVATIONS)}, got {activation!r}"
        )
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous f32 [T, K], got {x.dtype} {tuple(x.shape)}")
    num_tokens, width = x.shape
    if activation is not None and width % 2 != 0:
        raise ValueError(f"a gated activation needs an even [T, 2K] input, got width {width}")
    k = width // 2 if activation is not None else width
    if k == 0:
        raise ValueError("cannot quantize rows of width 0")
    if norm_weight is not None and (
        norm_weight.dtype != torch.float32 or norm_weight.shape != (k,) or not norm_weight.is_contiguous()
    ):
        raise ValueError(
            f"norm_weight must be contiguous f32 [{k}], got {norm_weight.dtype} {tuple(norm_weight.shape)}"
        )
    return num_tokens, k


def norm_quantize(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    *,
    activation: str | None = None,
    out_q: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x f32 [T, K] (or [T, 2K] = [gate | up] with "relu2" / "silu") -> (q int8 [T, K], s_act f32 [T]).

    Applies the gated activation, then RMSNorm with norm_weight f32 [K] and eps when norm_weight is given,
    then per-token absmax int8 quantization. Bit-identical with the torch reference (silu: up to the exp).
    CUDA-graph capturable: no host sync; out_q / out_scale, when given, are written in place.
    """
    num_tokens, k = _check_inputs(x, norm_weight, activation)
    q = out_q if out_q is not None else torch.empty(num_tokens, k, dtype=torch.int8, device=x.device)
    s_act = (
        out_scale if out_scale is not None else torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    )
    if q.shape != (num_tokens, k) or q.dtype != torch.int8 or not q.is_contiguous():
        raise ValueError(f"out_q must be contiguous int8 [{num_tokens}, {k}], got {q.dtype} {tuple(q.shape)}")
    if s_act.shape != (num_tokens,) or s_act.dtype != torch.float32:
        raise ValueError(f"out_scale must be f32 [{num_tokens}], got {s_act.dtype} {tuple(s_act.shape)}")
    if num_tokens == 0:
        return q, s_act
    block = triton.next_power_of_2(k)
    block = block if block <= MAX_SINGLE_BLOCK else CHUNK
    weight = norm_weight if norm_weight is not None else x  # a placeholder pointer, never read
    _norm_quantize_kernel[(num_tokens,)](
        x,
        weight,
        q,
        s_act,
        float(eps),
        K=k,
        BLOCK=block,
        ACT=ACTIVATIONS[activation],
        HAS_NORM=norm_weight is not None,
        USE_LIBDEVICE=x.device.type == "cuda",  # the CPU interpreter has no libdevice
        num_warps=NORM_QUANTIZE_WARPS.get(block, 4),
        enable_fp_fusion=False,
        **launch_options(x.device),
    )
    return q, s_act
