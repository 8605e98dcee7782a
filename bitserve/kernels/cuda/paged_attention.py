"""Paged decode attention on CUDA (Triton): flash-decoding over the paged KV cache, one query per sequence
(RoPE and the KV-cache write before it: rotary_cache.py; the varlen prefill: paged_prefill.py; the shared
numerics and checks: attention_blocks.py).

Graph capture: no kernel reads a device value on the host; every grid depends only on shapes (num_seqs,
heads, block-table width), so a captured decode step replays for any seq_lens.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.attention_blocks import (
    LOG2E,
    accumulate,
    attend_tile,
    check_attention_inputs,
    check_rows,
    kv_rows,
    online_softmax,
    split_query,
    split_terms,
    tile_pages,
    weight_scale,
)
from bitserve.kernels.cuda.pdl import launch_options, pdl_enter

MIN_KEYS_PER_SPLIT = 64  # flash-decoding: at least one tile of keys per split
MAX_SPLITS = 32


# ------------------------------------------------------------------ decode


@triton.jit
def _split_bounds(
    lens_ptr, seq, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr
):  # fmt: skip
    """(seq_len, start, end) of split `split` of the sequence's keys: the splits divide its own length,
    each a whole number of BLOCK_N tiles. WINDOW > 0 (a sliding layer): they divide only its last WINDOW
    keys, the ones the query (position seq_len - 1) sees, so older blocks are never read."""
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
        chunk = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = first + split * chunk
    else:
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * chunk
    return seq_len, start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _store_split(
    acc, m_i, l_i, out_ptr, lse_ptr, seq, split, heads, rows, dims, mask, out_stride_b, out_stride_h,
    out_stride_s, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, P_SCALE: tl.constexpr,
):  # fmt: skip
    """The split's normalized output [G, D] and, with several splits, its log2-sum-exp [G]."""
    total = tl.where(l_i > 0, l_i, 1.0) * P_SCALE  # an empty split (or seq_len 0) writes zeros
    out_rows = out_ptr + seq.to(tl.int64) * out_stride_b + heads * out_stride_h + split * out_stride_s
    tl.store(out_rows[:, None] + dims[None, :], acc / total[:, None], mask=mask)
    if NUM_SPLITS > 1:
        lse_rows = lse_ptr + (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))  # -inf: empty split
        tl.store(lse_rows, lse, mask=rows < GROUP)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
    q_stride_b, q_stride_h, kv_stride_blk, kv_stride_pos, kv_stride_head, table_stride,
    out_stride_b, out_stride_h, out_stride_s, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TERMS: tl.constexpr,
    P_SCALE: tl.constexpr, USE_PDL: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Program (seq, kv_head, split): the GROUP query heads of one KV head (rows padded to BLOCK_G, so
    each K / V tile is read once for the group) over split `split` of the sequence's keys (its last
    WINDOW keys where WINDOW > 0: every key of the splits is then visible, no mask beyond the length).
    With NUM_SPLITS 1 the output is final; else each split writes its normalized partial and
    log2-sum-exp. The first tile's keys older than the newest (seq_len - 1) are read before the PDL wait."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # seq_lens and the block table are the step's inputs: the split's bounds and its first tile's pages
    # (two dependent reads) are taken before the PDL wait (see pdl.py); q and the cache come after it
    seq_len, start, end = _split_bounds(lens_ptr, seq, split, NUM_SPLITS, BLOCK_N, WINDOW)
    table_row = table_ptr + seq.to(tl.int64) * table_stride
    first_keys = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k_head = k_ptr + kv_head * kv_stride_head
    v_head = v_ptr + kv_head * kv_stride_head
    first_pages = tile_pages(table_row, first_keys, end, BLOCK_SIZE)
    first_rows = kv_rows(first_pages, first_keys, kv_stride_blk, kv_stride_pos, BLOCK_SIZE)
    first_offs = first_rows[:, None] + dims[None, :]  # [N, D]
    dim_ok = (dims < HEAD_DIM)[None, :]
    newest = (first_keys == seq_len - 1)[:, None] & dim_ok  # the key this step's kernel before wrote
    # The other keys are earlier steps' cache entries, which no kernel of this step writes (the one before
    # writes each sequence's newest slot only: rotary_and_cache_): their K and V DRAM reads travel under
    # the previous kernel instead of after the wait.
    older = (first_keys < end)[:, None] & dim_ok & ~newest
    k_first = tl.load(k_head + first_offs, mask=older, other=0.0)
    v_first = tl.load(v_head + first_offs, mask=older, other=0.0)
    pdl_enter(USE_PDL)
    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = q_ptr + seq.to(tl.int64) * q_stride_b + heads * q_stride_h
    q = tl.load(q_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    # the newest key's row, now written (an L2 read), in place of its zeros
    k_first = tl.where(newest, tl.load(k_head + first_offs, mask=newest, other=0.0), k_first)
    v_first = tl.where(newest, tl.load(v_head + first_offs, mask=newest, other=0.0), v_first)
    q0, q1, q2, unscale = split_query(q * qk_scale, TERMS)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if start < end:  # an empty split (or seq_len 0) keeps the zeros: no key, no -inf - -inf
        m_i, alpha, l_i, p = online_softmax(q0, q1, q2, unscale, m_i, l_i, k_first, first_keys, end, rows,
                                            False, TERMS)  # fmt: skip
        acc = accumulate(acc, alpha, p, v_first, TERMS, P_SCALE)
    for tile in range(start + BLOCK_N, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        pages = tile_pages(table_row, keys, end, BLOCK_SIZE)
        m_i, l_i, acc = attend_tile(
            q0, q1, q2, unscale, m_i, l_i, acc, k_head, v_head, pages, keys, end, rows,
            kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, False, TERMS, P_SCALE,
        )  # fmt: skip
    _store_split(acc, m_i, l_i, out_ptr, lse_ptr, seq, split, heads, rows, dims, mask, out_stride_b,
                 out_stride_h, out_stride_s, GROUP, NUM_SPLITS, P_SCALE)  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, out_stride_b, out_stride_h,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (seq, head): merge the NUM_SPLITS partials [S, D] of one head by their weights
    2^(lse_s - max lse) (the log-sum-exp merge of flash-decoding)."""
    pdl_enter(USE_PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(lse_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)  # [S]: 0 for empty splits
    mask = split_ok[:, None] & (dims < HEAD_DIM)[None, :]
    parts = tl.load(part_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :], mask=mask)
    total = tl.maximum(tl.sum(weight, axis=0), 1e-30)
    merged = tl.sum(parts * weight[:, None], axis=0) / total
    out_row = out_ptr + seq.to(tl.int64) * out_stride_b + head * out_stride_h
    tl.store(out_row + dims, merged, mask=dims < HEAD_DIM)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (a fixed 132, an H100's, for the CPU interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Flash-decoding splits from host-known sizes only: enough (seq, kv head, split) programs to fill
    the GPU about twice, never a split shorter than MIN_KEYS_PER_SPLIT keys of the widest table row (or
    of the window, for a sliding layer: the caller passes the smaller)."""
    programs = num_seqs * num_kv_heads
    wanted = -(-2 * _sm_count(device) // programs)
    return max(1, min(wanted, max_keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def _split_count(
    num_splits: int | None,
    num_seqs: int,
    num_kv_heads: int,
    table_keys: int,
    window: int,
    device: torch.device,
) -> int:
    """The decode kernel's split count: num_splits where given, else decode_num_splits over the keys a
    query can read (the table's width, or a sliding layer's window)."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole context), got {window}")
    if num_splits is not None:
        return num_splits
    max_keys = min(table_keys, window) if window else table_keys
    return decode_num_splits(num_seqs, num_kv_heads, max_keys, device)


def _decode_config(
    head_dim: int, dtype: torch.dtype, programs: int, device: torch.device, tile: tuple[int, int, int] | None
) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages) of the decode kernel, measured on an H100 (f16 pages):
    8K-element K / V tiles (64 keys of D 128) keep three programs per SM busy; with eight or more programs
    per SM queued, 16K-element tiles stream ~8% faster. f32 pages of D 128 take 32-key tiles (registers:
    tf32x3 holds each operand twice). `tile` (KernelTuning.cuda_decode_tile, sweeps) replaces the choice for
    f16 / bf16 pages."""
    if dtype == torch.float32:
        return (32, 4, 3) if head_dim > 64 else (64, 4, 2)
    if tile is not None:
        return tile
    if head_dim <= 64 or programs >= 8 * _sm_count(device):
        return 128, 4, 3
    return 64, 4, 2


def _split_outputs(
    out: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """Where the decode kernel writes: (its output, its log2-sum-exp, the output's (seq, head, split)
    strides). One split writes `out` itself (the lse unused); several write partials [B, H, S, D] and an
    lse [B, H, S] that the reduce kernel merges into `out`."""
    if num_splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0)
    num_seqs, num_heads, head_dim = out.shape
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=out.device)
    return partial, lse, (partial.stride(0), partial.stride(1), partial.stride(2))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    tile: tuple[int, int, int] | None = None,
    window: int = 0,
) -> torch.Tensor:
    """One query per sequence over the paged cache -> f32 [B, H, D] (`out` when given).

    q f32 [B, H, D] (last dim contiguous); kv_cache [2, num_blocks, block_size, KVH, D] f32 / f16 /
    bf16, H a multiple of KVH; block_table int32 / int64 [B, max_blocks] (entries past a sequence's
    blocks are never read); seq_lens int32 / int64 [B] on the device, keys per sequence including this
    step's (0 gives a zero row). No host sync: capturable in a CUDA graph, grid from B, H and
    max_blocks. num_splits (tests, tuning) overrides the flash-decoding split count; 1 = one kernel; tile
    (BLOCK_N, num_warps, num_stages) the f16 / bf16 tile choice. window > 0 (a sliding layer): the query
    (position seq_len - 1) sees only the keys at seq_len - window .. seq_len - 1, and the blocks before
    them are not read; 0: the whole context (a compile-time constant: that kernel is unchanged).
    Under PDL the first tile's keys other than each sequence's newest (position seq_len - 1) are read
    before the kernel waits for the one launched before it, which may write those newest slots only (as
    rotary_and_cache_ does); cache entries written otherwise must come from a kernel further back.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    check_attention_inputs(q, kv_cache, block_table, num_heads, head_dim)
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    check_rows("out", out, torch.float32)
    if num_seqs == 0:
        return out
    table_keys = block_table.shape[1] * block_size
    num_splits = _split_count(num_splits, num_seqs, num_kv_heads, table_keys, window, q.device)
    group = num_heads // num_kv_heads
    programs = num_seqs * num_kv_heads * num_splits
    block_n, num_warps, num_stages = _decode_config(head_dim, kv_cache.dtype, programs, q.device, tile)
    block_d = triton.next_power_of_2(head_dim)
    target, lse, target_strides = _split_outputs(out, num_splits)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_table, seq_lens, target, lse,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), *target_strides, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        TERMS=split_terms(kv_cache), P_SCALE=weight_scale(kv_cache.dtype), WINDOW=window,
        num_warps=num_warps, num_stages=num_stages, **launch_options(q.device),
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            target, lse, out, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 2, **launch_options(q.device),
        )  # fmt: skip
    return out
