"""Paged attention on CUDA (Triton): decode (flash-decoding) and varlen prefill (RoPE and the KV-cache
write before it: rotary_cache.py).

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

Graph capture: no kernel reads a device value on the host; every grid depends only on shapes (num_seqs,
heads, block-table width, max_query_len), so a captured decode step replays for any seq_lens.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.pdl import launch_options, pdl_enter

LOG2E = 1.4426950408889634
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# terms the f32 left operand of a dot is split into, by cache dtype (0: f32 operands, tf32x3)
_SPLIT_TERMS = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 3}
_F16_WEIGHT_SCALE = 16384.0  # softmax weights p <= 1 times 2^14: hi + lo f16 terms stay normal
MIN_KEYS_PER_SPLIT = 64  # flash-decoding: at least one tile of keys per split
# decode: the first tile's K / V rows older than this step's key read before the PDL wait (an A/B switch;
# the contract it relies on: the kernel launched just before writes only each sequence's newest slot)
PREFETCH_OLD_KEYS = True
MAX_SPLITS = 32
# (BLOCK_N, num_warps, num_stages) for every f16 / bf16 decode launch instead of _decode_config's choice:
# a tuning switch for benchmarks/ab_gpu_decode.py, None in use
DECODE_CONFIG_OVERRIDE: tuple[int, int, int] | None = None


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
def _split_query(q, TERMS: tl.constexpr):
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
def _tile_pages(table_row_ptr, keys, key_end, BLOCK_SIZE: tl.constexpr):
    """The cache block of each key [N] below key_end, from the sequence's block-table row (0 past it)."""
    return tl.load(table_row_ptr + keys // BLOCK_SIZE, mask=keys < key_end, other=0)


@triton.jit
def _attend_tile(
    q0, q1, q2, unscale, m_i, l_i, acc,  # query terms [M, D], [M]; running max / sum [M]; acc [M, D]
    k_head_ptr, v_head_ptr, pages, keys, key_end, positions, kv_stride_blk, kv_stride_pos,
    dims, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, TERMS: tl.constexpr,
    P_SCALE: tl.constexpr,
):  # fmt: skip
    """One tile of keys [N] (< key_end; with CAUSAL, key <= the row's position) through online softmax
    (base 2: the scores carry log2(e)). pages [N]: each key's cache block (`_tile_pages`), read in place."""
    key_ok = keys < key_end
    rows = _kv_rows(pages, keys, kv_stride_blk, kv_stride_pos, BLOCK_SIZE)  # [N] element offsets
    kv_mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_head_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
    m_new, alpha, l_i, p = _online_softmax(q0, q1, q2, unscale, m_i, l_i, k, keys, key_end, positions,
                                           CAUSAL, TERMS)  # fmt: skip
    v = tl.load(v_head_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [N, D]
    return m_new, l_i, _accumulate(acc, alpha, p, v, TERMS, P_SCALE)


@triton.jit
def _kv_rows(pages, keys, kv_stride_blk, kv_stride_pos, BLOCK_SIZE: tl.constexpr):
    """Element offsets [N] of keys [N] in a layer's K (or V) cache, pages [N] their cache blocks."""
    return pages.to(tl.int64) * kv_stride_blk + (keys % BLOCK_SIZE) * kv_stride_pos


@triton.jit
def _online_softmax(
    q0, q1, q2, unscale, m_i, l_i, k, keys, key_end, positions, CAUSAL: tl.constexpr, TERMS: tl.constexpr
):  # fmt: skip
    """Scores of a K tile [N, D] and the online-softmax update: (new max, the old terms' factor alpha,
    new sum [M], weights p [M, N])."""
    key_ok = keys < key_end
    scores = _dot(q0, q1, q2, tl.trans(k), TERMS) * unscale[:, None]  # [M, N]
    if CAUSAL:
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
    else:
        visible = key_ok[None, :]
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every row sees key 0 in its first tile
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, l_i * alpha + tl.sum(p, axis=1), p


@triton.jit
def _accumulate(acc, alpha, p, v, TERMS: tl.constexpr, P_SCALE: tl.constexpr):
    """acc [M, D] rescaled by alpha [M] plus the weights p [M, N] times the V tile [N, D]."""
    p0, p1, p2 = _split(p * P_SCALE, TERMS)
    return acc * alpha[:, None] + _dot(p0, p1, p2, v, TERMS)


# ------------------------------------------------------------------ decode


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
    q_stride_b, q_stride_h, kv_stride_blk, kv_stride_pos, kv_stride_head, table_stride,
    out_stride_b, out_stride_h, out_stride_s, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TERMS: tl.constexpr,
    P_SCALE: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (seq, kv_head, split): the GROUP query heads of one KV head (rows padded to BLOCK_G, so
    each K / V tile is read once for the group) over split `split` of the sequence's keys. Splits divide
    the sequence's own length (read here), so work follows seq_lens while the grid does not. With
    NUM_SPLITS 1 the output is final; else each split writes its normalized partial and log2-sum-exp.
    PREFETCH: the first tile's keys older than the newest (seq_len - 1) are read before the PDL wait."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # seq_lens and the block table are the step's inputs: the split's bounds and its first tile's pages
    # (two dependent reads) are taken before the PDL wait (see pdl.py); q and the cache come after it
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    table_row = table_ptr + seq.to(tl.int64) * table_stride
    first_keys = start + tl.arange(0, BLOCK_N)
    first_pages = _tile_pages(table_row, first_keys, end, BLOCK_SIZE)
    dims = tl.arange(0, BLOCK_D)
    k_head = k_ptr + kv_head * kv_stride_head
    v_head = v_ptr + kv_head * kv_stride_head
    first_rows = _kv_rows(first_pages, first_keys, kv_stride_blk, kv_stride_pos, BLOCK_SIZE)
    first_offs = first_rows[:, None] + dims[None, :]  # [N, D]
    dim_ok = (dims < HEAD_DIM)[None, :]
    newest = (first_keys == seq_len - 1)[:, None] & dim_ok  # the key this step's kernel before wrote
    if PREFETCH:
        # The other keys are earlier steps' cache entries, which no kernel of this step writes (the one
        # before writes each sequence's newest slot only: rotary_and_cache_): their K and V DRAM reads
        # travel under the previous kernel instead of after the wait.
        older = (first_keys < end)[:, None] & dim_ok & ~newest
        k_first = tl.load(k_head + first_offs, mask=older, other=0.0)
        v_first = tl.load(v_head + first_offs, mask=older, other=0.0)
    pdl_enter(USE_PDL)
    rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + rows
    mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = q_ptr + seq.to(tl.int64) * q_stride_b + heads * q_stride_h
    q = tl.load(q_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    if PREFETCH:
        # the newest key's row, now written (an L2 read), in place of its zeros
        k_first = tl.where(newest, tl.load(k_head + first_offs, mask=newest, other=0.0), k_first)
        v_first = tl.where(newest, tl.load(v_head + first_offs, mask=newest, other=0.0), v_first)
    else:
        first_ok = (first_keys < end)[:, None] & dim_ok
        k_first = tl.load(k_head + first_offs, mask=first_ok, other=0.0)
        v_first = tl.load(v_head + first_offs, mask=first_ok, other=0.0)
    q0, q1, q2, unscale = _split_query(q * qk_scale, TERMS)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if start < end:  # an empty split (or seq_len 0) keeps the zeros: no key, no -inf - -inf
        m_i, alpha, l_i, p = _online_softmax(q0, q1, q2, unscale, m_i, l_i, k_first, first_keys, end, rows,
                                             False, TERMS)  # fmt: skip
        acc = _accumulate(acc, alpha, p, v_first, TERMS, P_SCALE)
    for tile in range(start + BLOCK_N, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)
        pages = _tile_pages(table_row, keys, end, BLOCK_SIZE)
        m_i, l_i, acc = _attend_tile(
            q0, q1, q2, unscale, m_i, l_i, acc, k_head, v_head, pages, keys, end, rows,
            kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, False, TERMS, P_SCALE,
        )  # fmt: skip
    total = tl.where(l_i > 0, l_i, 1.0) * P_SCALE  # an empty split (or seq_len 0) writes zeros
    out_rows = out_ptr + seq.to(tl.int64) * out_stride_b + heads * out_stride_h + split * out_stride_s
    tl.store(out_rows[:, None] + dims[None, :], acc / total[:, None], mask=mask)
    if NUM_SPLITS > 1:
        lse_rows = lse_ptr + (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))  # -inf: empty split
        tl.store(lse_rows, lse, mask=rows < GROUP)


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
    the GPU about twice, never a split shorter than MIN_KEYS_PER_SPLIT keys of the widest table row."""
    programs = num_seqs * num_kv_heads
    wanted = -(-2 * _sm_count(device) // programs)
    return max(1, min(wanted, max_keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def _decode_config(
    head_dim: int, dtype: torch.dtype, programs: int, device: torch.device
) -> tuple[int, int, int]:
    """(BLOCK_N keys per tile, num_warps, num_stages) of the decode kernel, measured on an H100 (f16 pages):
    8K-element K / V tiles (64 keys of D 128) keep three programs per SM busy; with eight or more programs
    per SM queued, 16K-element tiles stream ~8% faster. f32 pages of D 128 take 32-key tiles (registers:
    tf32x3 holds each operand twice)."""
    if dtype == torch.float32:
        return (32, 4, 3) if head_dim > 64 else (64, 4, 2)
    if DECODE_CONFIG_OVERRIDE is not None:
        return DECODE_CONFIG_OVERRIDE
    if head_dim <= 64 or programs >= 8 * _sm_count(device):
        return 128, 4, 3
    return 64, 4, 2


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query per sequence over the paged cache -> f32 [B, H, D] (`out` when given).

    q f32 [B, H, D] (last dim contiguous); kv_cache [2, num_blocks, block_size, KVH, D] f32 / f16 /
    bf16, H a multiple of KVH; block_table int32 / int64 [B, max_blocks] (entries past a sequence's
    blocks are never read); seq_lens int32 / int64 [B] on the device, keys per sequence including this
    step's (0 gives a zero row). No host sync: capturable in a CUDA graph, grid from B, H and
    max_blocks. num_splits (tests, tuning) overrides the flash-decoding split count; 1 = one kernel.
    Under PDL the first tile's keys other than each sequence's newest (position seq_len - 1) are read
    before the kernel waits for the one launched before it, which may write those newest slots only (as
    rotary_and_cache_ does); cache entries written otherwise must come from a kernel further back.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    _check_attention_inputs(q, kv_cache, block_table, num_heads, head_dim)
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    check_rows("out", out, torch.float32)
    if num_seqs == 0:
        return out
    if num_splits is None:
        max_keys = block_table.shape[1] * block_size
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_keys, q.device)
    group = num_heads // num_kv_heads
    programs = num_seqs * num_kv_heads * num_splits
    block_n, num_warps, num_stages = _decode_config(head_dim, kv_cache.dtype, programs, q.device)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        target, target_strides = partial, (partial.stride(0), partial.stride(1), partial.stride(2))
    else:
        lse, target, target_strides = out, out, (out.stride(0), out.stride(1), 0)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_table, seq_lens, target, lse,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0), *target_strides, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        TERMS=_split_terms(kv_cache), P_SCALE=_weight_scale(kv_cache.dtype), PREFETCH=PREFETCH_OLD_KEYS,
        num_warps=num_warps, num_stages=num_stages, **launch_options(q.device),
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            partial, lse, out, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 2, **launch_options(q.device),
        )  # fmt: skip
    return out


# ------------------------------------------------------------------ prefill


@triton.jit(do_not_specialize=["table_stride"])  # the batch's table width varies step to step
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, starts_ptr, out_ptr,
    q_stride_t, q_stride_h, out_stride_t, out_stride_h, kv_stride_blk, kv_stride_pos, kv_stride_head,
    table_stride, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TERMS: tl.constexpr,
    P_SCALE: tl.constexpr,
):  # fmt: skip
    """Program (query tile, kv_head, seq): BLOCK_M rows = BLOCK_M // GROUP_PAD queries x the GROUP
    heads of one KV head (each K / V tile read once for the group). Query i of the sequence's n sits at
    position seq_len - n + i and sees keys 0..position. Key tiles wholly below the tile's first
    position skip the causal mask; the rest apply it."""
    tile, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    q_start = tl.load(starts_ptr + seq).to(tl.int32)
    num_queries = tl.load(starts_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_Q >= num_queries:
        return
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    query = tile * BLOCK_Q + rows // GROUP_PAD
    member = rows % GROUP_PAD
    mask = ((query < num_queries) & (member < GROUP))[:, None] & (dims < HEAD_DIM)[None, :]
    positions = seq_len - num_queries + query  # [M]
    tokens = (q_start + query).to(tl.int64)
    heads = kv_head * GROUP + member
    q_rows = q_ptr + tokens * q_stride_t + heads * q_stride_h
    q = tl.load(q_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    q0, q1, q2, unscale = _split_query(q * qk_scale, TERMS)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_position = seq_len - num_queries + tile * BLOCK_Q
    key_end = tl.minimum(seq_len, first_position + BLOCK_Q)
    unmasked_end = ((first_position + 1) // BLOCK_N) * BLOCK_N
    table_row = table_ptr + seq.to(tl.int64) * table_stride
    k_head = k_ptr + kv_head * kv_stride_head
    v_head = v_ptr + kv_head * kv_stride_head
    for start in range(0, unmasked_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        pages = _tile_pages(table_row, keys, key_end, BLOCK_SIZE)
        m_i, l_i, acc = _attend_tile(
            q0, q1, q2, unscale, m_i, l_i, acc, k_head, v_head, pages, keys, key_end, positions,
            kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, False, TERMS, P_SCALE,
        )  # fmt: skip
    for start in range(unmasked_end, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        pages = _tile_pages(table_row, keys, key_end, BLOCK_SIZE)
        m_i, l_i, acc = _attend_tile(
            q0, q1, q2, unscale, m_i, l_i, acc, k_head, v_head, pages, keys, key_end, positions,
            kv_stride_blk, kv_stride_pos, dims, HEAD_DIM, BLOCK_SIZE, True, TERMS, P_SCALE,
        )  # fmt: skip
    total = tl.where(l_i > 0, l_i, 1.0) * P_SCALE
    out_rows = out_ptr + tokens * out_stride_t + heads * out_stride_h
    tl.store(out_rows[:, None] + dims[None, :], acc / total[:, None], mask=mask)


def _prefill_config(head_dim: int, dtype: torch.dtype, group_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) for the prefill kernel."""
    block_m = max(64, group_pad)
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
) -> torch.Tensor:
    """Varlen causal attention of query chunks over the paged cache -> f32 [T, H, D] (`out` when given).

    q f32 [T, H, D] (last dim contiguous): sequence s owns rows query_start_loc[s]:query_start_loc[s+1]
    (n_s of them), query i sitting at position seq_lens[s] - n_s + i; its keys, the chunk's own
    included, are already in the pages. query_start_loc int32 / int64 [S + 1] and seq_lens [S] stay on
    the device; max_query_len (host int, >= every n_s) sizes the grid. Decodes (n = 1) and prefill
    chunks over a cached prefix mix freely. block_table / kv_cache as in paged_decode_attention.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    _check_attention_inputs(q, kv_cache, block_table, num_heads, head_dim)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    check_rows("out", out, torch.float32)
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
        TERMS=_split_terms(kv_cache), P_SCALE=_weight_scale(kv_cache.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------ checks


def _split_terms(kv_cache: torch.Tensor) -> int:
    """Terms of the f32 left operand of each dot. The CPU interpreter multiplies bf16 dot operands as
    their raw bits: there, a bf16 cache is upcast to f32 (tf32x3 path) instead."""
    if kv_cache.dtype == torch.bfloat16 and kv_cache.device.type != "cuda":
        return 0
    return _SPLIT_TERMS[kv_cache.dtype]


def _weight_scale(dtype: torch.dtype) -> float:
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


def _check_attention_inputs(
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
