"""Blocked causal attention with grouped KV heads, the eager f32 path for prefill (and the full forward).

Queries go in blocks of a few dozen tokens; a block attends only to the keys up to its last query, so the
masked upper triangle is neither computed nor stored (half the FLOPs of a full [queries, keys] product
at a fresh prompt), and only the diagonal tile is masked. The KV heads are never repeated: the `group`
query heads that share a KV head are stacked as rows of one batched matmul per KV head
([num_kv_heads, group * block, head_dim] x [num_kv_heads, head_dim, keys]). Imports torch only.
"""

from __future__ import annotations

import torch

MAX_QUERY_BLOCK = 64  # queries per block: the masked corner of the diagonal tile stays small
MIN_QUERY_BLOCK = 16  # long contexts: no smaller, or the batched matmuls get too thin
SCORE_BLOCK_FLOATS = 1 << 18  # f32 scores per block (1 MiB) within the cap: they stay in cache


def query_block_size(num_heads: int, num_context: int) -> int:
    """Queries per block: MAX_QUERY_BLOCK, fewer when a block's scores would pass SCORE_BLOCK_FLOATS."""
    fits = SCORE_BLOCK_FLOATS // max(1, num_heads * num_context)
    return max(MIN_QUERY_BLOCK, min(MAX_QUERY_BLOCK, fits))


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int = 0
) -> torch.Tensor:
    """q f32 [num_queries, num_heads, head_dim]: the last num_queries positions of a context whose keys
    and values are f32 [num_context, num_kv_heads, head_dim] -> f32 [num_queries, num_heads, head_dim].

    Head h reads KV head h // group (repeat_interleave's pairing). Each query sees the keys at its own
    position and before (with a `window`, only the last `window` of those, its own included: a sliding
    layer); softmax(q.k * scale) over those, then the weighted sum of their values."""
    if window > 0:
        return _windowed_attention(q, keys, values, scale, window)
    num_queries, num_heads, head_dim = q.shape
    num_context, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    first_position = num_context - num_queries  # the context position of query 0
    keys_by_head = keys.transpose(0, 1).contiguous()  # [num_kv_heads, num_context, head_dim]
    values_by_head = values.transpose(0, 1).contiguous()
    out = torch.empty(num_queries, num_heads, head_dim, dtype=q.dtype, device=q.device)
    block = query_block_size(num_heads, num_context)
    # [block, block]: True where the key comes after the query
    future = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
    for start in range(0, num_queries, block):
        end = min(start + block, num_queries)
        size = end - start
        num_keys = first_position + end  # keys visible to the block's last query
        # [size, kv_heads, group, head_dim] -> [kv_heads, group * size, head_dim] (rows: group-major)
        block_q = q[start:end].view(size, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        block_q = block_q.reshape(num_kv_heads, group * size, head_dim)
        scores = torch.bmm(block_q, keys_by_head[:, :num_keys].transpose(1, 2))  # [kv, group*size, keys]
        scores.mul_(scale)
        # the diagonal tile: keys first_position + start .. num_keys - 1 against this block's queries
        diagonal = scores.view(num_kv_heads, group, size, num_keys)[..., num_keys - size :]
        diagonal.masked_fill_(future[:size, :size], float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # [kv_heads, group * size, num_keys]
        block_out = torch.bmm(weights, values_by_head[:, :num_keys])  # [kv_heads, group * size, head_dim]
        # [kv_heads, group, size, head_dim] -> [size, kv_heads, group, head_dim] = out rows [size, heads, dim]
        out[start:end].view(size, num_kv_heads, group, head_dim).copy_(
            block_out.view(num_kv_heads, group, size, head_dim).permute(2, 0, 1, 3)
        )
    return out


def _windowed_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """causal_attention over a sliding window: a block of queries reads only the keys some query of it
    sees (from window - 1 before its first position), each query's band masked explicitly."""
    num_queries, num_heads, head_dim = q.shape
    num_context, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    first_position = num_context - num_queries
    keys_by_head = keys.transpose(0, 1).contiguous()  # [num_kv_heads, num_context, head_dim]
    values_by_head = values.transpose(0, 1).contiguous()
    out = torch.empty(num_queries, num_heads, head_dim, dtype=q.dtype, device=q.device)
    block = query_block_size(num_heads, min(num_context, window + MAX_QUERY_BLOCK))
    for start in range(0, num_queries, block):
        end = min(start + block, num_queries)
        size = end - start
        first_key = max(0, first_position + start - window + 1)
        key_ids = torch.arange(first_key, first_position + end, device=q.device)  # [num_keys]
        query_positions = torch.arange(first_position + start, first_position + end, device=q.device)
        offset = query_positions[:, None] - key_ids[None, :]  # [size, num_keys]: how far back each key is
        hidden = (offset < 0) | (offset >= window)
        block_q = q[start:end].view(size, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        block_q = block_q.reshape(num_kv_heads, group * size, head_dim)
        block_keys = keys_by_head[:, first_key : first_position + end]
        scores = torch.bmm(block_q, block_keys.transpose(1, 2)).mul_(scale)  # [kv, group * size, keys]
        scores.view(num_kv_heads, group, size, -1).masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        block_out = torch.bmm(weights, values_by_head[:, first_key : first_position + end])
        out[start:end].view(size, num_kv_heads, group, head_dim).copy_(
            block_out.view(num_kv_heads, group, size, head_dim).permute(2, 0, 1, 3)
        )
    return out
