"""Paged attention's shared parts (Triton): the numerics' building blocks (operand splits, a tile of keys
through online softmax) and the argument checks, used by decode (paged_attention.py), prefill
(paged_prefill.py) and the RoPE + KV write (rotary_cache.py).

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim] in f32, f16 or
bf16; token p of a sequence sits at slot `block_table[p // block_size] * block_size + p % block_size`
(layers/attention.py). Queries, outputs and all arithmetic are f32.

Numerics: attention runs its products on tensor cores at near-f32 accuracy: an f32 cache uses tf32x3
(three tf32 products), an f16 / bf16 cache multiplies its own dtype exactly with f32 accumulation, the
f32 left operand (q, or the softmax weights) being split into 2 (f16) or 3 (bf16) terms of that dtype
whose sum carries ~22-24 significant bits. For f16, q rows are scaled by a power of two (max |q| of a
row near 2^14) and the weights by 2^14 before the split, so no term overflows or sinks to subnormals;
the powers of two are undone exactly. Softmax is online (running max, exp2 with log2(e) folded into the
scale), summed in f32: tolerance-level parity with the eager f32 path (~1e-6 relative).
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# terms the f32 left operand of a dot is split into, by cache dtype (0: f32 operands, tf32x3)
_SPLIT_TERMS = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}
_F16_WEIGHT_SCALE = 16384.0  # softmax weights p <= 1 times 2^14: hi + lo f16 terms stay normal


# ------------------------------------------------------------------ attention building blocks


@triton.jit
def _pow2(exponent):
    """2.0 ** exponent as an exact f32, for int32 exponent in [-126, 127]."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _split(x, TERMS: tl.constexpr):
    """f32 x -> (x0, x1, x2) in the dot dtype with x ~= x0 + x1 (+ x2): f16 hi / lo (TERMS 2), bf16
    hi / mid / lo (TERMS 3); TERMS 0 leaves x f32 (the dot then splits it itself: tf32x3)."""
    # NOTE: if / else with one return: Triton traces code after an early return too
    if TERMS == 0:
        x0, x1, x2 = x, x, x
    else:
        dtype: tl.constexpr = tl.float16 if TERMS == 2 else tl.bfloat16
        x0 = x.to(dtype)
        rest = x - x0.to(tl.float32)
        x1 = rest.to(dtype)
        x2 = (rest - x1.to(tl.float32)).to(dtype)
    return x0, x1, x2


@triton.jit
def _dot(a0, a1, a2, b, TERMS: tl.constexpr):
    """(a0 + a1 (+ a2)) @ b -> f32 [M, N], products exact (f16 / bf16) and summed in f32, smallest
    term first; TERMS 0: a0 @ f32(b) in tf32x3."""
    if TERMS == 0:
        acc = tl.dot(a0, b.to(tl.float32), input_precision="tf32x3")
    elif TERMS == 3:
        acc = tl.dot(a0, b, tl.dot(a1, b, tl.dot(a2, b)))
    else:
        acc = tl.dot(a0, b, tl.dot(a1, b))
    return acc


@triton.jit
def split_query(q, TERMS: tl.constexpr):
    """q f32 [M, D] (scale folded in) -> its split terms and the f32 [M] factor undoing a per-row
    power-of-two scale (f16 only: each row's max |q| is brought to [2^14, 2^15), below f16's max and far
    above its subnormals, so both terms keep their precision)."""
    if TERMS == 2:
        peak = tl.max(tl.abs(q), axis=1)
        exponent = ((peak.to(tl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2(peak))
        shift = tl.minimum(tl.maximum(14 - exponent, -126), 126)
        q0, q1, q2 = _split(q * _pow2(shift)[:, None], TERMS)
        unscale = _pow2(-shift)
    else:
        q0, q1, q2 = _split(q, TERMS)
        unscale = tl.full([q.shape[0]], 1.0, tl.float32)
    return q0, q1, q2, unscale


@triton.jit
def tile_pages(table_row_ptr, keys, key_end, BLOCK_SIZE: tl.constexpr):
    """The cache block of each key [N] below key_end, from the sequence's block-table row (0 past it)."""
    return tl.load(table_row_ptr + keys // BLOCK_SIZE, mask=keys < key_end, other=0)


@triton.jit
def attend_tile(
    q0, q1, q2, unscale, m_i, l_i, acc,  # query terms [M, D], [M]; running max / sum [M]; acc [M, D]
    k_head_ptr, v_head_ptr, pages, keys, key_end, positions, kv_stride_blk, kv_stride_pos,
    dims, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, TERMS: tl.constexpr,
    P_SCALE: tl.constexpr, WINDOW: tl.constexpr = 0,
):  # fmt: skip
    """One tile of keys [N] (< key_end; with CAUSAL, key <= the row's position, and with a WINDOW > 0
    also key > position - WINDOW) through online softmax (base 2: the scores carry log2(e)). pages [N]:
    each key's cache block (`tile_pages`), read in place."""
    key_ok = keys < key_end
    rows = kv_rows(pages, keys, kv_stride_blk, kv_stride_pos, BLOCK_SIZE)  # [N] element offsets
    kv_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_head_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
    m_new, alpha, l_i, p = online_softmax(q0, q1, q2, unscale, m_i, l_i, k, keys, key_end, positions,
                                           CAUSAL, TERMS, WINDOW)  # fmt: skip
    v = tl.load(v_head_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
    return m_new, l_i, accumulate(acc, alpha, p, v, TERMS, P_SCALE)


@triton.jit
def kv_rows(pages, keys, kv_stride_blk, kv_stride_pos, BLOCK_SIZE: tl.constexpr):
    """Element offsets [N] of keys [N] in a layer's K (or V) cache, pages [N] their cache blocks."""
    return pages.to(tl.int64) * kv_stride_blk + (keys % BLOCK_SIZE) * kv_stride_pos


@triton.jit
def online_softmax(
    q0, q1, q2, unscale, m_i, l_i, k, keys, key_end, positions, CAUSAL: tl.constexpr, TERMS: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):  # fmt: skip
    """Scores of a K tile [N, D] and the online-softmax update: (new max, the old terms' factor alpha,
    new sum [M], weights p [M, N]). WINDOW > 0 (with CAUSAL): a sliding layer's band, keys older than
    position - WINDOW + 1 hidden too."""
    key_ok = keys < key_end
    scores = _dot(q0, q1, q2, tl.trans(k), TERMS) * unscale[:, None]  # [M, N]
    if CAUSAL:
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        if WINDOW > 0:
            visible = visible & (keys[None, :] > positions[:, None] - WINDOW)
    else:
        visible = key_ok[None, :]
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every row sees key 0 in its first tile
    if WINDOW > 0:
        # a band's rows can see no key of a tile before their own: keep their max -inf but shift by 0,
        # so alpha and p are 0, not exp2(-inf - -inf) = NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        shift = m_new
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(scores - shift[:, None])
    return m_new, alpha, l_i * alpha + tl.sum(p, axis=1), p


@triton.jit
def accumulate(acc, alpha, p, v, TERMS: tl.constexpr, P_SCALE: tl.constexpr):
    """acc [M, D] rescaled by alpha [M] plus the weights p [M, N] times the V tile [N, D]."""
    p0, p1, p2 = _split(p * P_SCALE, TERMS)
    return acc * alpha[:, None] + _dot(p0, p1, p2, v, TERMS)


# ------------------------------------------------------------------ checks


def split_terms(kv_cache: torch.Tensor) -> int:
    """Terms of the f32 left operand of each dot. The CPU interpreter multiplies bf16 dot operands as
    their raw bits: there, a bf16 cache is upcast to f32 (tf32x3 path) instead."""
    if kv_cache.dtype == torch.bfloat16 and kv_cache.device.type != "cuda":
        return 0
    return _SPLIT_TERMS[kv_cache.dtype]


def weight_scale(dtype: torch.dtype) -> float:
    return _F16_WEIGHT_SCALE if dtype == torch.float16 else 1.0


def check_rows(name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    """x [rows, heads, D] of `dtype`, last dim contiguous (rows and heads may have any stride)."""
    if x.dtype != dtype or x.dim() != 3 or (x.shape[2] > 1 and x.stride(2) != 1):
        raise ValueError(f"{name} must be {dtype} [rows, heads, D] with a contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")  # fmt: skip


def check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """kv_cache [2, num_blocks, block_size (a power of two), KVH, D], last dim contiguous."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, kv_heads, D] f32 / f16 / bf16, got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)}")  # fmt: skip
    block_size = kv_cache.shape[2]
    if block_size & (block_size - 1) or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)}: block_size must be a power of two and "
                         f"(kv_heads, D) = {(num_kv_heads, head_dim)}")  # fmt: skip
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache needs a contiguous last dim")


def check_attention_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    check_rows("q", q, torch.float32)
    num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 0
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of the cache's kv heads {num_kv_heads}")
    check_cache(kv_cache, num_kv_heads, head_dim)
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 / int64 [seqs, max_blocks], got {block_table.dtype}")
    if block_table.stride(1) != 1 and block_table.shape[1] > 1:
        raise ValueError("block_table needs contiguous rows")
