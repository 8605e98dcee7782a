"""bitnet.cpp's f32 arithmetic outside the ternary kernels, bit for bit (x86 AVX2 + F16C + FMA, clang,
llamafile sgemm on, no flash attention): attention, RMS norm and an F16 LM head (docs/fidelity-bitnetcpp.md).

Attention

ggml's graph (llama.cpp `llm_build_kqv`): kq = mul_mat(K, Q); soft_max_ext(kq, mask, scale); kqv =
mul_mat(V^T, kq). K and V live in an F16 cache; the key count is padded to a multiple of 32 (masked, -inf
scores, zero weights: they change no value, only the chunk layout, which starts at key 0 either way).

- K.Q: Q is a permuted view, so ggml rounds it to F16 and runs `ggml_vec_dot_f16` per (key, query, head)
  (tinyBLAS takes no F16 x F16 on AVX2): 4 x 8 f32 accumulators over 32-value chunks, then its reduce.
- softmax: s * scale (f32), + mask, max, `ggml_v_expf(s - max)` (a polynomial exp, not expf) per chunk
  of 8 keys, each chunk's f32 horizontal sum added to an f64 total; weights * fl32(1 / total).
- KQV: the weights [keys, tokens] are contiguous: with >= 2 tokens llamafile's tinyBLAS multiplies F16 V
  by the f32 weights (8 f32 lanes, an FMA chain over keys, then hsum); a one-token step rounds the
  weights to F16 and runs `ggml_vec_dot_f16` over the keys.

Products of two F16 values are exact in f32, so ggml's FMA there is a plain f32 add of the product;
tinyBLAS's F16 x f32 products are not, and go through `fma_exact` (an f64 FMA, exact in f32).

RMS norm: ggml squares in f32 and sums the squares in f64 (`sum += (ggml_float)(x * x)`).
F16 head: one row is rounded to F16 and runs `ggml_vec_dot_f16` per vocab row; two or more rows run
tinyBLAS (f32 rows, FMA lanes) as for KQV.
"""

from __future__ import annotations

import numpy as np
import torch

from bitserve.kernels.reference.ternary import fma_f32

VEC_DOT_CHUNK = 32  # ggml_vec_dot_f16 (AVX): GGML_F16_STEP, 4 accumulators (GGML_F16_ARR) of 8 lanes
LANES = 8  # __m256 of f32
QUERY_BLOCK = 16  # queries per K.Q block: bounds the [heads, block, keys, 32] product tensor
HEAD_BLOCK = (
    8192  # vocab rows per head block: bounds the [rows, block, 32] f32 / [rows, block, 8] f64 tensors
)
F32_DROPPED_BITS = 29  # f64 fraction bits below an f32 fraction (52 - 23)


def fma_exact(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fl32(a * b + c) with one rounding, for f32 tensors (broadcast); `fma_f32`'s result, ~8x faster.

    a * b is exact in f64 and so is the f64 sum unless the exponents are far apart; rounding that sum
    to f32 can then be off only where it sits exactly halfway between two f32 values (its 29 dropped
    bits are 1000...0) or is an f32 subnormal: only those elements (~0.5%) take the exact `fma_f32`."""
    s = a.double() * b.double() + c.double()
    r = s.float()
    low = s.view(torch.int64) & ((1 << F32_DROPPED_BITS) - 1)
    doubtful = (low == 1 << (F32_DROPPED_BITS - 1)) | ((r.abs() < 2.0**-126) & (r != 0))
    if bool(doubtful.any()):
        a, b, c = (t.expand(s.shape)[doubtful] for t in (a, b, c))
        r[doubtful] = fma_f32(a, b, c)
    return r


def pad_last(x: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    """x with its last dim padded by `value` to a multiple of `multiple`."""
    extra = -x.shape[-1] % multiple
    if not extra:
        return x
    return torch.nn.functional.pad(x, (0, extra), value=value)


def vec_dot_f16_reduce(acc: torch.Tensor) -> torch.Tensor:
    """GGML_F32x8_REDUCE of acc [..., 4, 8] (4 accumulators x 8 lanes) -> [...]:
    (x0 + x2) + (x1 + x3), then lanes i + (i + 4), then hadd twice: (t0 + t1) + (t2 + t3)."""
    x = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])  # [..., 8]
    t = x[..., :4] + x[..., 4:]
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def hsum8(x: torch.Tensor) -> torch.Tensor:
    """llamafile's / the softmax's hsum of x [..., 8] -> [...]: t_i = x_i + x_{i+4}, (t0 + t2) + (t1 + t3)."""
    t = x[..., 4:] + x[..., :4]
    return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])


def vec_dot_f16(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ggml_vec_dot_f16 of F16-valued f32 tensors x, y [..., n] (broadcast) -> [...].

    Lane (j, l) accumulates x[32c + 8j + l] * y[...] over the whole chunks c in order (the products are
    exact); after the reduce, the n % 32 leftover products are added one by one in f64 (ggml_float), and
    the f64 total is rounded to f32 (e.g. a 100-dim head: 3 chunks, then 4 leftovers)."""
    n = x.shape[-1]
    whole = n - n % VEC_DOT_CHUNK
    if whole:
        xs = x[..., :whole].unflatten(-1, (whole // VEC_DOT_CHUNK, 4, LANES))
        ys = y[..., :whole].unflatten(-1, (whole // VEC_DOT_CHUNK, 4, LANES))
        acc = xs[..., 0, :, :] * ys[..., 0, :, :]
        for c in range(1, whole // VEC_DOT_CHUNK):
            acc = acc + xs[..., c, :, :] * ys[..., c, :, :]
        total = vec_dot_f16_reduce(acc)
    else:
        total = torch.zeros(torch.broadcast_shapes(x.shape[:-1], y.shape[:-1]), dtype=torch.float32)
    if whole == n:
        return total
    total = total.double()
    for i in range(whole, n):
        total = total + (x[..., i] * y[..., i]).double()
    return total.float()


def kq_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [heads, queries, dim], k [heads, keys, dim] (F16 values in f32) -> kq [heads, queries, keys] f32."""
    blocks = []
    for start in range(0, q.shape[1], QUERY_BLOCK):
        block = q[:, start : start + QUERY_BLOCK]  # [heads, b, dim]
        blocks.append(vec_dot_f16(block[:, :, None, :], k[:, None, :, :]))  # [heads, b, keys]
    return torch.cat(blocks, dim=1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint32 patterns held in int64 -> f32."""
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def ggml_v_expf(x: torch.Tensor) -> torch.Tensor:
    """ggml_v_expf (AVX2 + FMA) of f32 x, bit-exact: exp(x) = 2^n (1 + j(b)), n = round(x / ln 2),
    b the Cody-Waite remainder, j a degree-5 polynomial; |n| > 126 scales in two steps, > 192 gives 0/inf."""
    r = _f32(float.fromhex("0x1.8p23"))
    z = fma_f32(x, _f32(float.fromhex("0x1.715476p+0")), r)
    n = z - r
    b = fma_f32(-n, _f32(float.fromhex("0x1.7f7d1cp-20")), fma_f32(-n, _f32(float.fromhex("0x1.62e4p-1")), x))
    e = (_bits(z) << 23) & 0xFFFFFFFF
    k = _from_bits(e + _bits(_f32(1.0)))
    u = b * b
    j = fma_f32(
        fma_f32(
            fma_f32(_f32(float.fromhex("0x1.0e4020p-7")), b, _f32(float.fromhex("0x1.573e2ep-5"))),
            u,
            fma_f32(_f32(float.fromhex("0x1.555e66p-3")), b, _f32(float.fromhex("0x1.fffdb6p-2"))),
        ),
        u,
        _f32(float.fromhex("0x1.ffffecp-1")) * b,
    )
    normal = fma_f32(k, j, k)
    big = n.abs() > 126
    if not bool(big.any()):
        return normal
    g = torch.where(n <= 0, 0x82000000, 0)
    s1 = _from_bits(g + 0x7F000000)
    s2 = _from_bits(e - g)
    scaled = fma_f32(s2, j, s2) * s1
    huge = n.abs() > 192
    return torch.where(huge, s1 * s1, torch.where(big, scaled, normal))


def soft_max(kq: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """ggml_compute_forward_soft_max_f32 over the last dim of kq [..., keys] (keys a multiple of 8).

    scale: f32 scalar tensor; mask: bool [..., keys] broadcastable, True where the key is hidden."""
    w = kq * scale
    if mask is not None:
        w = w.masked_fill(mask, float("-inf"))
    top = w.amax(dim=-1, keepdim=True)
    values = ggml_v_expf(w - top)  # [..., keys]
    chunk_sums = hsum8(values.unflatten(-1, (-1, LANES))).double()  # [..., keys / 8]
    total = torch.zeros(chunk_sums.shape[:-1], dtype=torch.float64)
    for c in range(chunk_sums.shape[-1]):  # sequential f64 sum, as ggml's loop
        total = total + chunk_sums[..., c]
    inverse = (1.0 / total).float()  # ggml_vec_scale_f32 takes a float
    return values * inverse.unsqueeze(-1)


def kqv_tinyblas(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """tinyBLAS<8, __m256, F16, f32>: weights [heads, queries, keys] f32, v [heads, keys, dim] F16-valued
    -> [heads, queries, dim]. Lane l accumulates fma(v[8c + l], w[8c + l], acc) over key chunks c."""
    num_keys = weights.shape[-1]
    w = weights.unflatten(-1, (num_keys // LANES, LANES))  # [h, q, c, 8]
    vt = v.transpose(1, 2).unflatten(-1, (num_keys // LANES, LANES))  # [h, dim, c, 8]
    acc = torch.zeros(weights.shape[0], weights.shape[1], v.shape[2], LANES, dtype=torch.float32)
    for c in range(num_keys // LANES):
        acc = fma_exact(vt[:, None, :, c, :], w[:, :, None, c, :], acc)  # [h, q, dim, 8]
    return hsum8(acc)


def kqv_vec_dot(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A one-token step: weights [heads, 1, keys] rounded to F16, then ggml_vec_dot_f16 with each V row."""
    w = weights.to(torch.float16).to(torch.float32)
    return vec_dot_f16(w[:, :, None, :], v.transpose(1, 2)[:, None, :, :])  # [heads, 1, dim]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_context: int,
    scale: torch.Tensor,
    one_token_step: bool,
) -> torch.Tensor:
    """q [heads, queries, dim] (the last queries of a causal context), k/v [heads, num_context, dim], all
    F16-valued f32 -> [heads, queries, dim], as ggml computes it. one_token_step: the ggml batch holds
    a single token (its KQV rounds the weights to F16)."""
    num_queries = q.shape[1]
    keys = -(-num_context // VEC_DOT_CHUNK) * VEC_DOT_CHUNK  # ggml pads the KV view to 32 cells
    k = torch.nn.functional.pad(k, (0, 0, 0, keys - num_context))
    v = torch.nn.functional.pad(v, (0, 0, 0, keys - num_context))
    query_pos = torch.arange(num_context - num_queries, num_context).unsqueeze(1)
    hidden = torch.arange(keys).unsqueeze(0) > query_pos  # [queries, keys]
    weights = soft_max(kq_scores(q, k), scale, hidden)
    if one_token_step:
        return kqv_vec_dot(weights, v)
    return kqv_tinyblas(weights, v)


def rms_norm_inverse(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_compute_forward_rms_norm_f32's scale of x [..., width] -> [..., 1]: f32 squares summed in f64,
    mean = fl32(sum / width), 1.0f / sqrtf(mean + eps)."""
    mean = x.square().double().mean(dim=-1, keepdim=True).float()
    # NOTE: torch.rsqrt, not 1 / torch.sqrt: torch's f32 sqrt here is not correctly rounded on ~17% of
    # inputs (measured against numpy), its rsqrt equals fl32(1 / sqrtf(x)) on all 51M tried
    return torch.rsqrt(mean + torch.tensor(eps, dtype=torch.float32))


def f16_head_one_row(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x f32 [1, K] rounded to F16, weight [V, K] (F16 values, f16 or f32) -> [1, V]: ggml_vec_dot_f16."""
    x = x.to(torch.float16).to(torch.float32)
    blocks = [
        vec_dot_f16(x, weight[start : start + HEAD_BLOCK].to(torch.float32))
        for start in range(0, weight.shape[0], HEAD_BLOCK)
    ]
    return torch.cat(blocks).unsqueeze(0)


def f16_head_tinyblas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x f32 [T, K] (T >= 2), weight [V, K] -> [T, V]: tinyBLAS's lanes, an FMA chain over K / 8 chunks."""
    xs = x.unflatten(-1, (-1, LANES))  # [T, K / 8, 8]
    blocks = []
    for start in range(0, weight.shape[0], HEAD_BLOCK):
        w = weight[start : start + HEAD_BLOCK].to(torch.float32).unflatten(-1, (-1, LANES))  # [b, K / 8, 8]
        acc = torch.zeros(x.shape[0], w.shape[0], LANES, dtype=torch.float32)
        for c in range(w.shape[1]):
            acc = fma_exact(w[None, :, c, :], xs[:, None, c, :], acc)  # [T, b, 8]
        blocks.append(hsum8(acc))
    return torch.cat(blocks, dim=1)


def kq_scale(head_dim: int) -> torch.Tensor:
    """llama.cpp's 1.0f / sqrtf(head_dim), in f32 (numpy's sqrt: correctly rounded, as sqrtf)."""
    return torch.tensor(np.float32(1.0) / np.sqrt(np.float32(head_dim)), dtype=torch.float32)
