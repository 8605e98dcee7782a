"""RoPE on q and k and the KV-cache write of k and v, in one Triton launch (before paged attention).

Numerics: the layer's `x0*cos - x1*sin`, `x0*sin + x1*cos` with every product and sum rounded on its
own (launched with `enable_fp_fusion=False`: no FMA contraction), so q and k match the eager
RotaryEmbedding bit for bit; k and v are cast to the cache dtype round-to-nearest-even, as
`tensor.to(dtype)` does. The cache layout is paged_attention.py's.
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.attention_blocks import check_cache, check_rows
from bitserve.kernels.cuda.pdl import launch_options, pdl_enter


@triton.jit
def _rotate_rows(
    src_ptr, head_stride,  # this token's row of heads: head h at src_ptr + h * head_stride
    dst_ptr, dst_head_stride,  # where the rotated pairs go: the row itself, or its cache slot
    cos, sin, half_ok,  # f32 [BLOCK_HALF] of this position; pair mask
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr, dst_mask, SOFT_BF16: tl.constexpr,  # dst_mask: scalar, write at all
):  # fmt: skip
    """Rotate pairs (x[i], x[i + HALF]) (NEOX) or (x[2i], x[2i+1]) (NORM) of NUM_HEADS heads."""
    heads = tl.arange(0, BLOCK_HEADS)
    pairs = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:
        first_dim, second_dim = pairs, pairs + HALF
    else:
        first_dim, second_dim = 2 * pairs, 2 * pairs + 1
    mask = (heads < NUM_HEADS)[:, None] & half_ok[None, :]
    src = src_ptr + heads[:, None] * head_stride
    dst = dst_ptr + heads[:, None] * dst_head_stride
    first = tl.load(src + first_dim[None, :], mask=mask, other=0.0)
    second = tl.load(src + second_dim[None, :], mask=mask, other=0.0)
    # the eager layer's order, each product rounded on its own (no FMA: see the launch)
    out_first = first * cos[None, :] - second * sin[None, :]
    out_second = first * sin[None, :] + second * cos[None, :]
    # NOTE: not `mask & dst_mask`: Triton 3.6's CPU interpreter rejects a block mask and-ed with a loaded
    # scalar ("mask has unsupported dtype"); where() gives the same mask on both
    store_mask = tl.where(dst_mask, mask, False)
    _store_cast(dst + first_dim[None, :], out_first, store_mask, SOFT_BF16)
    _store_cast(dst + second_dim[None, :], out_second, store_mask, SOFT_BF16)


@triton.jit
def _store_cast(ptrs, values, mask, SOFT_BF16: tl.constexpr):
    """Store f32 values as ptrs' dtype, rounded to nearest even (tensor.to(dtype)'s rounding). SOFT_BF16
    (the CPU interpreter, whose own f32 -> bf16 cast truncates) rounds bf16 on the bits instead."""
    dtype: tl.constexpr = ptrs.dtype.element_ty
    if SOFT_BF16 and dtype == tl.bfloat16:
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptrs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, values.to(dtype), mask=mask)


@triton.jit
def _copy_rows(
    src_ptr, src_head_stride, dst_ptr, dst_head_stride, dst_mask, first_dim, NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, SOFT_BF16: tl.constexpr,
):  # fmt: skip
    """dst[h, d] = src[h, d] cast to dst's dtype (round to nearest even), for d >= first_dim."""
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_HEADS)[:, None] & ((dims >= first_dim) & (dims < HEAD_DIM))[None, :]
    values = tl.load(src_ptr + heads[:, None] * src_head_stride + dims[None, :], mask=mask, other=0.0)
    dst = dst_ptr + heads[:, None] * dst_head_stride + dims[None, :]
    _store_cast(dst, values, tl.where(dst_mask, mask, False), SOFT_BF16)  # (see _rotate_rows)


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cs_stride,
    cache_stride_blk, cache_stride_pos, cache_stride_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, SOFT_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One program per token: q rotated in place; k rotated in place and into its cache slot (rest
    of the head copied); v copied into its slot."""
    token = tl.program_id(0).to(tl.int64)
    # the step's inputs and the RoPE tables, before the PDL wait (see pdl.py): position -> cos / sin
    # are two dependent reads that now run under the previous kernel
    position = tl.load(positions_ptr + token)
    slot = tl.load(slots_ptr + token)
    has_slot = slot >= 0  # a negative slot (a padded token) writes no cache entry
    slot = tl.maximum(slot, 0)
    pairs = tl.arange(0, BLOCK_HALF)
    half_ok = pairs < HALF
    cos = tl.load(cos_ptr + position * cs_stride + pairs, mask=half_ok, other=0.0)
    sin = tl.load(sin_ptr + position * cs_stride + pairs, mask=half_ok, other=0.0)
    pdl_enter(USE_PDL)
    q_row = q_ptr + token * q_stride_t
    k_row = k_ptr + token * k_stride_t
    cache_offset = (slot // BLOCK_SIZE) * cache_stride_blk + (slot % BLOCK_SIZE) * cache_stride_pos
    k_slot = k_cache_ptr + cache_offset
    # the pass-through dims of k go to the cache first: k's rotated dims are rewritten below
    _copy_rows(k_row, k_stride_h, k_slot, cache_stride_head, has_slot, 2 * HALF,
               NUM_KV_HEADS, HEAD_DIM, BLOCK_KVH, BLOCK_D, SOFT_BF16)  # fmt: skip
    _copy_rows(v_ptr + token * v_stride_t, v_stride_h, v_cache_ptr + cache_offset, cache_stride_head,
               has_slot, 0, NUM_KV_HEADS, HEAD_DIM, BLOCK_KVH, BLOCK_D, SOFT_BF16)  # fmt: skip
    _rotate_rows(k_row, k_stride_h, k_slot, cache_stride_head, cos, sin, half_ok,
                 NUM_KV_HEADS, HALF, IS_NEOX, BLOCK_KVH, BLOCK_HALF, has_slot, SOFT_BF16)  # fmt: skip
    _rotate_rows(k_row, k_stride_h, k_row, k_stride_h, cos, sin, half_ok,
                 NUM_KV_HEADS, HALF, IS_NEOX, BLOCK_KVH, BLOCK_HALF, True, False)  # fmt: skip
    _rotate_rows(q_row, q_stride_h, q_row, q_stride_h, cos, sin, half_ok,
                 NUM_HEADS, HALF, IS_NEOX, BLOCK_H, BLOCK_HALF, True, False)  # fmt: skip


def rotary_and_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """RoPE on q and k in place, and k (rotated), v written into their cache slots: one launch.

    q f32 [T, H, D], k / v f32 [T, KVH, D]: the last dim contiguous, the head stride D-compatible
    (any token-row stride: column views of a stacked q/k/v output work). positions int64 [T];
    cos / sin f32 [max_positions, rope_dim // 2] (RotaryEmbedding's tables, not the ggml ones);
    kv_cache [2, num_blocks, block_size, KVH, D] f32 / f16 / bf16; slot_mapping int64 [T] (a negative
    slot writes nothing). q and k equal the eager RotaryEmbedding's output bit for bit; the cache gets
    k and v cast round-to-nearest-even, as PagedAttention._write_kv stores them.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    check_rows("q", q, torch.float32)
    check_rows("k", k, torch.float32)
    check_rows("v", v, torch.float32)
    check_cache(kv_cache, num_kv_heads, head_dim)
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, kv_heads, {head_dim}]")
    if rope_dim % 2 or not 0 < rope_dim <= head_dim or cos.shape[1] != rope_dim // 2:
        raise ValueError(f"rope_dim {rope_dim} does not fit head_dim {head_dim} / tables {tuple(cos.shape)}")
    if cos.dtype != torch.float32 or sin.stride() != cos.stride() or cos.stride(1) != 1:
        raise ValueError(
            "cos / sin must be f32 [max_positions, rope_dim // 2] with equal, unit-column strides"
        )
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _rotary_cache_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, key_cache, value_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=rope_dim // 2,
        IS_NEOX=is_neox, BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(rope_dim // 2),
        BLOCK_D=triton.next_power_of_2(head_dim), SOFT_BF16=q.device.type != "cuda", num_warps=4,
        enable_fp_fusion=False, **launch_options(q.device),
    )  # fmt: skip
