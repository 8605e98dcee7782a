"""Reference ternary linear (docs/formats.md §3), pure torch on any device: the oracle for fast backends.

int8 per-token activation quantization -> exact integer accumulation -> f32 epilogue, plus the
`float` and `llamacpp-tq` modes. Every function is written for obvious exactness, not speed.
"""

from __future__ import annotations

import torch

from bitserve.kernels.packed import TernaryCodes

QK_K = 256  # values per TQ / Q8_K block
NUM_TQ_LANES = 8  # int32 lanes of ggml's AVX2 TQ2_0 dot product (one __m256i)
AMAX_FLOOR = 1e-5  # docs/formats.md §3.1: amax = max(1e-5, max|x|), in float64


# ---------------------------------------------------------------- bitnet mode


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 quantization (bitnet.cpp I2_S, docs/formats.md §3.1).

    x: f32 [T, K] -> (q int8 [T, K], s_act f32 [T]).
    amax is taken in f64 (max of |x| is exact in f32, so widening after the max is the same), s_act is
    127/amax divided in f64 and rounded once to f32, q = clamp(rne(fl32(x * s_act)), -128, 127).
    """
    amax = x.abs().amax(dim=1).to(torch.float64).clamp_min(AMAX_FLOOR)  # [T]
    # NOTE: tensor / tensor; torch's `scalar / tensor` multiplies by a reciprocal (two roundings)
    s_act = (torch.full_like(amax, 127.0) / amax).to(torch.float32)  # [T]
    # f32 product (one rounding), then round-half-to-even: torch.round is RNE
    q = torch.round(x * s_act[:, None]).clamp_(-128, 127).to(torch.int8)  # [T, K]
    return q, s_act


def integer_matmul(q: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """D = q @ values^T exactly. q int8 [T, K], values int8 [M, K] -> int32 [T, M].

    Computed in float64: every product and partial sum is an integer below 2^53, so each step is exact
    whatever order the matmul sums in.
    """
    d = torch.matmul(q.to(torch.float64), values.to(torch.float64).t())  # [T, M]
    return d.to(torch.int32)


def block_integer_matmul(q: torch.Tensor, values: torch.Tensor, block: int = QK_K) -> torch.Tensor:
    """Per-block partial dot products D_b. q int8 [T, K], values int8 [M, K] -> int32 [T, M, K//block]."""
    num_tokens, k = q.shape
    num_blocks = k // block
    qb = q.to(torch.float64).view(num_tokens, num_blocks, block)  # [T, nb, block]
    wb = values.to(torch.float64).view(values.shape[0], num_blocks, block)  # [M, nb, block]
    return torch.einsum("tbk,mbk->tmb", qb, wb).to(torch.int32)  # [T, M, nb]


def bitnet_epilogue(d: torch.Tensor, s_act: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = fl32(fl32(fl32(D) / s_act) * w_scale): divide, then multiply, two separate roundings.

    d int32 [T, M], s_act f32 [T], w_scale f32 scalar -> f32 [T, M]. |D| < 2^24, so fl32(D) is exact.
    """
    return (d.to(torch.float32) / s_act[:, None]) * w_scale


def bitnet_block_epilogue(d_blocks: torch.Tensor, s_act: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-block scales: y = sum over b in increasing order of fl32(fl32(fl32(D_b) / s_act) * d_b).

    d_blocks int32 [T, M, nb], s_act f32 [T], scale f32 [M, nb] -> f32 [T, M]. The running sum starts at
    +0.0 and adds one block term at a time (f32 rounding after each add); this order is the contract
    every backend reproduces.
    """
    num_tokens, m, num_blocks = d_blocks.shape
    y = torch.zeros(num_tokens, m, dtype=torch.float32, device=d_blocks.device)
    for b in range(num_blocks):
        term = (d_blocks[:, :, b].to(torch.float32) / s_act[:, None]) * scale[:, b]  # [T, M]
        y = y + term
    return y


def bitnet_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The full pipeline of docs/formats.md §3.1-3.3.

    x f32 [T, K], values int8 [M, K], scale f32 scalar or [M, K//256].
    """
    q, s_act = quantize_activations(x)
    return bitnet_linear_quantized(q, s_act, values, scale)


def bitnet_linear_quantized(
    q: torch.Tensor, s_act: torch.Tensor, values: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """bitnet_linear after activation quantization (shared by linear_group)."""
    if scale.dim() == 0:
        return bitnet_epilogue(integer_matmul(q, values), s_act, scale)
    block = values.shape[1] // scale.shape[1]
    return bitnet_block_epilogue(block_integer_matmul(q, values, block), s_act, scale)


def collapse_block_scales(codes: TernaryCodes) -> TernaryCodes:
    """Turn per-block scales into one per-tensor scale when every block holding a non-zero value has
    the same scale (an all-zero block contributes nothing whatever its d; TQ writes d = 0 there).

    Such a tensor then follows the per-tensor I2_S epilogue, like a TQ file whose blocks all share d.
    Otherwise the codes are returned unchanged.
    """
    if codes.is_per_tensor:
        return codes
    m, k = codes.values.shape
    num_blocks = codes.scale.shape[1]
    has_nonzero = codes.values.view(m, num_blocks, k // num_blocks).ne(0).any(dim=2)  # [M, nb]
    used = codes.scale[has_nonzero]
    if used.numel() == 0:
        return TernaryCodes(values=codes.values, scale=codes.scale.reshape(-1)[0].clone())
    if bool((used == used[0]).all()):
        return TernaryCodes(values=codes.values, scale=used[0].clone())
    return codes


def check_ternary_codes(codes: TernaryCodes) -> tuple[int, int]:
    """Validate a TernaryCodes record (loader output) and return (M, K)."""
    values, scale = codes.values, codes.scale
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(f"ternary values must be int8 [M, K], got {values.dtype} {tuple(values.shape)}")
    m, k = values.shape
    if scale.dtype != torch.float32:
        raise ValueError(f"ternary scale must be float32, got {scale.dtype}")
    if scale.dim() == 2:
        if scale.shape[0] != m or scale.shape[1] == 0 or k % scale.shape[1] != 0:
            raise ValueError(f"per-block scale {tuple(scale.shape)} does not tile a [{m}, {k}] matrix")
    elif scale.dim() != 0:
        raise ValueError(f"ternary scale must be a scalar or [M, K // block], got {tuple(scale.shape)}")
    if bool((values.abs() > 1).any()):
        raise ValueError("ternary values must lie in {-1, 0, 1}")
    return m, k


# ---------------------------------------------------------------- float mode


def dequantize_ternary(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t * scale as f32 [M, K] (per-block scales repeated along K). Used by the float mode."""
    w = values.to(torch.float32)
    if scale.dim() == 0:
        return w * scale
    block = values.shape[1] // scale.shape[1]
    return w * scale.repeat_interleave(block, dim=1)


# ---------------------------------------------------------------- llamacpp-tq mode


def f16_block_scales(codes: TernaryCodes) -> torch.Tensor:
    """Per-256-block weight scales as a TQ file holds them: f16 values widened to f32, [M, K // 256].

    TQ scales are f16 already (rounding is then the identity); an I2_S per-tensor f32 scale is
    rounded to f16 as if the tensor had been requantized to TQ2_0.
    """
    m, k = codes.values.shape
    num_blocks = k // QK_K
    scale = codes.scale.to(torch.float16).to(torch.float32)
    if scale.dim() == 0:
        return scale.expand(m, num_blocks).contiguous()
    if scale.shape[1] != num_blocks:
        raise ValueError(f"llamacpp-tq needs one scale per {QK_K} values, got {tuple(scale.shape)}")
    return scale.contiguous()


def quantize_q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml quantize_row_q8_K_ref per 256-value block. x f32 [T, K] -> (q int8 [T, K], d f32 [T, nb]).

    max = the signed value of largest magnitude (first one on ties), iscale = fl32(-127 / max),
    q = min(127, rne(fl32(iscale * x))), d = fl32(1 / iscale); an all-zero block gets d = 0, q = 0.
    """
    num_tokens, k = x.shape
    xb = x.view(num_tokens, k // QK_K, QK_K)  # [T, nb, 256]
    absx = xb.abs()
    amax = absx.amax(dim=2, keepdim=True)  # [T, nb, 1]
    first = (absx == amax).to(torch.int8).argmax(dim=2, keepdim=True)  # first index of the max
    signed_max = torch.gather(xb, 2, first)  # [T, nb, 1]
    is_zero = amax == 0
    safe_max = torch.where(is_zero, torch.ones_like(signed_max), signed_max)
    iscale = torch.full_like(safe_max, -127.0) / safe_max  # [T, nb, 1], true f32 division
    q = torch.round(iscale * xb).clamp_(max=127)  # ggml: MIN(127, nearest_int(iscale * x))
    q = torch.where(is_zero, torch.zeros_like(q), q).to(torch.int8).view(num_tokens, k)
    d = torch.where(is_zero, torch.zeros_like(iscale), torch.ones_like(iscale) / iscale)
    d = d.view(num_tokens, k // QK_K)  # [T, nb]
    return q, d


def _lane_view(t: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, nb, 8 lanes, 32]: lane L of a block holds elements 32c + 4L + r (c < 8, r < 4).

    These are the values one int32 lane of ggml's AVX2 TQ2_0 kernel sums: maddubs pairs bytes
    (2p, 2p+1) of each 32-byte vector, madd_epi16 pairs int16 lanes (2L, 2L+1).
    """
    r, k = t.shape
    v = t.view(r, k // QK_K, 8, 8, 4)  # [R, nb, c, L, r]
    return v.permute(0, 1, 3, 2, 4).reshape(r, k // QK_K, NUM_TQ_LANES, 32)


def tq_lane_sums(q8: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The 8 int32 lane sums per block of ggml_vec_dot_tq2_0_q8_K (AVX2) for every (token, row).

    q8 int8 [T, K], values int8 [M, K] -> int32 [T, M, nb, 8].
    The kernel multiplies codes (t + 1) by q and subtracts the Q8_K bsums: lane L gets
    sum_{E_L} (t + 1) q - sum_{e in [32L, 32L + 32)} q, with E_L as in `_lane_view`.
    """
    num_tokens, k = q8.shape
    qf = q8.to(torch.float64)
    q_lanes = _lane_view(qf)  # [T, nb, 8, 32]
    w_lanes = _lane_view(values.to(torch.float64))  # [M, nb, 8, 32]
    dot = torch.einsum("tblk,mblk->tmbl", q_lanes, w_lanes)  # [T, M, nb, 8], exact in f64
    bsums = qf.view(num_tokens, k // QK_K, NUM_TQ_LANES, 32).sum(dim=3)  # [T, nb, 8]
    correction = q_lanes.sum(dim=3) - bsums  # [T, nb, 8]
    return (dot + correction[:, None]).to(torch.int32)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """IEEE fusedMultiplyAdd in f32: fl32(a * b + c) with one rounding, for f32 tensors (broadcast).

    a * b is exact in f64 (24 + 24 significand bits); TwoSum gives s + e == a * b + c exactly. Rounding s
    to f32 is then correct unless s lies exactly halfway between two f32 values and e != 0, in which
    case e decides the direction (the double-rounding case).
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    virtual = s - p
    e = (p - (s - virtual)) + (c64 - virtual)  # TwoSum error term
    r = s.float()
    r64 = r.double()
    toward = torch.where(s > r64, torch.inf, -torch.inf).float()
    neighbour = torch.nextafter(r, toward)  # the other f32 candidate around s
    is_tie = (s != r64) & ((s - r64) * 2 == neighbour.double() - r64)
    directed = torch.where(e > 0, torch.maximum(r, neighbour), torch.minimum(r, neighbour))
    return torch.where(is_tie & (e != 0), directed, r)


def tq_epilogue(lanes: torch.Tensor, d_x: torch.Tensor, d_w: torch.Tensor) -> torch.Tensor:
    """ggml's float accumulation of the TQ2_0 AVX2 dot product.

    lanes int32 [T, M, nb, 8], d_x f32 [T, nb] (Q8_K d), d_w f32 [M, nb] (f16 block scale) -> f32 [T, M].
    Per block b in order: d = fl32(d_x * d_w); acc_L = fma(fl32(lane_L), d, acc_L). NOTE: the fused
    multiply-add is what GCC makes of ggml's `_mm256_add_ps(_mm256_mul_ps(...), sumf)` (it contracts
    across the intrinsics; llama-cpp-python's x86-64 build does). Builds that do not contract (clang,
    MSVC) round the product separately and can differ in the last bit.
    Then hsum_float_8: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
    """
    num_tokens, m, num_blocks, _ = lanes.shape
    acc = torch.zeros(num_tokens, m, NUM_TQ_LANES, dtype=torch.float32, device=lanes.device)
    for b in range(num_blocks):
        d = d_x[:, None, b] * d_w[None, :, b]  # [T, M]
        acc = fma_f32(lanes[:, :, b, :].to(torch.float32), d[:, :, None], acc)
    r = acc[..., 4:] + acc[..., :4]  # [T, M, 4]: lanes (4+i) + i
    return (r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])


def llamacpp_tq_linear(x: torch.Tensor, values: torch.Tensor, d_w: torch.Tensor) -> torch.Tensor:
    """Upstream llama.cpp TQ dot product. x f32 [T, K], values int8 [M, K], d_w f32 [M, K//256]."""
    q8, d_x = quantize_q8k(x)
    return tq_epilogue(tq_lane_sums(q8, values), d_x, d_w)
