"""Varlen paged prefill attention on CUDA (Triton): query chunks of several sequences over the paged KV
cache, causal, decodes and prefill chunks over a cached prefix mixed (shared numerics and checks:
attention_blocks.py).

Graph capture: no kernel reads a device value on the host; the grid depends only on shapes (heads,
sequences, max_query_len).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.attention_blocks import (
    LOG2E,
    attend_tile,
    check_attention_inputs,
    check_rows,
    split_query,
    split_terms,
    tile_pages,
    weight_scale,
)


@triton.jit
def _band(first_position, key_end, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """A query tile's band of key tiles that need the window's mask: (the first tile any of its rows
    sees, the first tile whose keys are all inside every real row's window). Rows sit at first_position
    .. key_end - 1, so keys >= key_end - WINDOW are in every band; tiles before band_start are unread."""
    band_start = tl.maximum(first_position - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    band_end = tl.minimum(tl.cdiv(tl.maximum(key_end - WINDOW, 0), BLOCK_N) * BLOCK_N, key_end)
    return band_start, band_end


@triton.jit
def _attend_keys(
    q0, q1, q2, unscale, m_i, l_i, acc, first, last, table_row, k_head, v_head, key_end, positions,
    kv_stride_blk, kv_stride_pos, dims, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, TERMS: tl.constexpr, P_SCALE: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    """The key tiles first, first + BLOCK_N, ... below last through attend_tile (its masks: CAUSAL,
    WINDOW) -> the updated (m_i, l_i, acc)."""
    for start in range(first, last, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        pages = tile_pages(table_row, keys, key_end, BLOCK_SIZE)
        m_i, l_i, acc = attend_tile(
            q0, q1, q2, unscale, m_i, l_i, acc, k_head, v_head, pages, keys, key_end, positions,
            kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, CAUSAL, TERMS, P_SCALE, WINDOW,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["table_stride"])  # the batch's table width varies step to step
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, starts_ptr, out_ptr,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, kv_stride_blk, kv_stride_pos, kv_stride_head,
    table_stride, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TERMS: tl.constexpr,
    P_SCALE: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Program (query tile, kv_head, seq): BLOCK_M rows = BLOCK_M // GROUP_PAD queries x the GROUP
    heads of one KV head (each K / V tile read once for the group). Query i of the sequence's n sits at
    position seq_len - n + i and sees keys 0..position (WINDOW > 0: position - WINDOW + 1..position).
    Key tiles wholly below the tile's first position (and inside every row's window) skip the mask; the
    rest apply it; tiles before every row's window are not read."""
    tile, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_start = tl.load(starts_ptr + seq).to(tl.int32)
    num_queries = tl.load(starts_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_Q >= num_queries:
        return
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    rows, dims = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    query = tile * BLOCK_Q + rows // GROUP_PAD
    member = rows % GROUP_PAD
    mask = ((query < num_queries) & (member < GROUP))[:, None] & (dims < HEAD_DIM)[None, :]
    positions = seq_len - num_queries + query  # [M]
    tokens = (q_start + query).to(tl.int64)
    heads = kv_head * GROUP + member
    q_rows = q_ptr + tokens * q_stride_t + heads * q_stride_h
    q = tl.load(q_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    q0, q1, q2, unscale = split_query(q * qk_scale, TERMS)
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_position = seq_len - num_queries + tile * BLOCK_Q
    key_end = tl.minimum(seq_len, first_position + BLOCK_Q)
    unmasked_end = ((first_position + 1) // BLOCK_N) * BLOCK_N
    table_row = table_ptr + seq.to(tl.int64) * table_stride
    k_head, v_head = k_ptr + kv_head * kv_stride_head, v_ptr + kv_head * kv_stride_head
    if WINDOW > 0:  # a sliding layer: the band's tiles first, masked both ways
        band_start, band_end = _band(first_position, key_end, WINDOW, BLOCK_N)
        m_i, l_i, acc = _attend_keys(
            q0, q1, q2, unscale, m_i, l_i, acc, band_start, band_end, table_row, k_head, v_head, key_end,
            positions, kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, TERMS,
            P_SCALE, WINDOW,
        )  # fmt: skip
        unmasked_start, causal_start = band_end, tl.maximum(band_end, unmasked_end)
    else:
        unmasked_start, causal_start = 0, unmasked_end
    m_i, l_i, acc = _attend_keys(
        q0, q1, q2, unscale, m_i, l_i, acc, unmasked_start, unmasked_end, table_row, k_head, v_head,
        key_end, positions, kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False,
        TERMS, P_SCALE, 0,
    )  # fmt: skip
    m_i, l_i, acc = _attend_keys(
        q0, q1, q2, unscale, m_i, l_i, acc, causal_start, key_end, table_row, k_head, v_head, key_end,
        positions, kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, TERMS, P_SCALE,
        0,
    )  # fmt: skip
    total = tl.where(l_i > 0, l_i, 1.0) * P_SCALE
    out_rows = out_ptr + tokens * out_stride_t + heads * out_stride_h
    tl.store(out_rows[:, None] + dims[None, :], acc / total[:, None], mask=mask)


def _prefill_config(head_dim: int, dtype: torch.dtype, group_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for the prefill kernel. f32 pages of D 256
    (Gemma 3's heads) take 16-key tiles: with 32 the sm_90 kernel needs 256 KiB of shared memory, over
    the H100 / H200's 227 KiB a block (16: 192 KiB, by Triton's sm_90 compile)."""
    block_m = max(64, group_pad)
    if dtype == torch.float32 and head_dim > 128:
        return block_m, 16, 4, 2
    if dtype == torch.float32 and head_dim > 64:
        return block_m, 32, 4, 2
    return block_m, 64, 4, 2


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    window: int = 0,
) -> torch.Tensor:
    """Varlen causal attention of query chunks over the paged cache -> f32 [T, H, D] (`out` when given).

    q f32 [T, H, D] (last dim contiguous): sequence s owns rows query_start_loc[s]:query_start_loc[s+1]
    (n_s of them), query i sitting at position seq_lens[s] - n_s + i; its keys, the chunk's own
    included, are already in the pages. query_start_loc int32 / int64 [S + 1] and seq_lens [S] stay on
    the device; max_query_len (host int, >= every n_s) sizes the grid. Decodes (n = 1) and prefill
    chunks over a cached prefix mix freely. block_table / kv_cache as in paged_decode_attention.
    window > 0 (a sliding layer): query i sees only the keys at its position - window + 1 .. position,
    and key tiles before the query tile's first band are not read; 0: the whole causal context (a
    compile-time constant: that kernel is unchanged).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    check_attention_inputs(q, kv_cache, block_table, num_heads, head_dim)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    check_rows("out", out, torch.float32)
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole context), got {window}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {num_seqs} sequences")
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m, block_n, num_warps, num_stages = _prefill_config(head_dim, kv_cache.dtype, group_pad)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_query_len, block_m // group_pad), num_kv_heads, num_seqs)
    _prefill_kernel[grid](
        q, key_cache, value_cache, block_table, seq_lens, query_start_loc, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        scale * LOG2E, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n,
        TERMS=split_terms(kv_cache), P_SCALE=weight_scale(kv_cache.dtype), WINDOW=window,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
