"""Prefill attention: the blocked causal attention against a naive one (K/V repeated per query head, the
full [queries, keys] score matrix masked) over block edges, GQA and chunks that continue a context; and
PagedAttention's fresh-prompt path (attends over the step's own k / v) bit for bit against the pages."""

from __future__ import annotations

import math

import pytest
import torch

from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.layers import causal_attention as blocked
from bitserve.layers.attention import PagedAttention


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [Tq, H, D], keys / values [C, KV, D]; queries at the last Tq positions -> [Tq, H, D]."""
    num_queries, num_heads, head_dim = q.shape
    num_context, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, C, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(head_dim)  # [H, Tq, C]
    query_pos = torch.arange(num_context - num_queries, num_context).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(num_context).unsqueeze(0) > query_pos, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize(
    ("num_queries", "num_context"),
    [(1, 1), (7, 7), (64, 64), (65, 65), (150, 150), (1, 40), (23, 100), (130, 200)],
)
def test_blocked_attention_equals_the_naive_one(
    num_heads: int, num_kv_heads: int, num_queries: int, num_context: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads * 1000 + num_queries * 7 + num_context)
    head_dim = 16
    q = torch.randn(num_queries, num_heads, head_dim, generator=gen)
    keys = torch.randn(num_context, num_kv_heads, head_dim, generator=gen)
    values = torch.randn(num_context, num_kv_heads, head_dim, generator=gen)
    out = blocked.causal_attention(q, keys, values, 1.0 / math.sqrt(head_dim))
    torch.testing.assert_close(out, naive_attention(q, keys, values), rtol=1e-5, atol=1e-5)


def test_long_contexts_take_smaller_query_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert blocked.query_block_size(9, 512) == 56  # 2^18 score floats / (9 heads * 512 keys)
    assert blocked.query_block_size(9, 64) == blocked.MAX_QUERY_BLOCK
    assert blocked.query_block_size(32, 100_000) == blocked.MIN_QUERY_BLOCK
    monkeypatch.setattr(blocked, "SCORE_BLOCK_FLOATS", 6 * 40 * 20)  # 20-query blocks over 40 keys
    gen = torch.Generator().manual_seed(1)
    q, keys, values = (torch.randn(40, n, 8, generator=gen) for n in (6, 2, 2))
    out = blocked.causal_attention(q, keys, values, 1.0 / math.sqrt(8))
    torch.testing.assert_close(out, naive_attention(q, keys, values), rtol=1e-5, atol=1e-5)


def paged_batch(
    lengths: list[tuple[int, int]], num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[AttentionMetadata, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Sequences of (cached, new) tokens with their cached k / v already in scattered pages; returns the
    step's metadata, the cache and each sequence's cached (keys, values) [cached, kv_heads, head_dim]."""
    block_size, num_blocks = 4, 64
    gen = torch.Generator().manual_seed(len(lengths) * 100 + num_kv_heads)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    pages = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(-(-(cached + new) // block_size) for cached, new in lengths)
    block_table = torch.zeros(len(lengths), max_blocks, dtype=torch.int64)
    slots, history, query_start_loc = [], [], [0]
    for row, (cached, new) in enumerate(lengths):
        used = -(-(cached + new) // block_size)
        block_table[row, :used] = pages[row * max_blocks : row * max_blocks + used]
        flat = [
            int(block_table[row, p // block_size]) * block_size + p % block_size for p in range(cached + new)
        ]
        old_k, old_v = (torch.randn(cached, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
        kv_cache[0].flatten(0, 1)[flat[:cached]] = old_k
        kv_cache[1].flatten(0, 1)[flat[:cached]] = old_v
        history.append((old_k.float(), old_v.float()))
        slots += flat[cached:]
        query_start_loc.append(query_start_loc[-1] + new)
    seq_lens = [cached + new for cached, new in lengths]
    metadata = AttentionMetadata.from_host(
        torch.tensor(slots), block_table, seq_lens, query_start_loc, block_size
    )
    return metadata, kv_cache, history


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_prefill_attends_over_the_whole_context(dtype: torch.dtype) -> None:
    """A fresh prompt, a chunk continuing a cached prefix and a one-token step in one batch, against the
    naive attention over each sequence's cached k / v followed by this step's (rounded as the cache is)."""
    num_heads, num_kv_heads, head_dim = 9, 3, 16
    lengths = [(0, 70), (37, 29), (12, 1)]
    metadata, kv_cache, history = paged_batch(lengths, num_kv_heads, head_dim, dtype)
    gen = torch.Generator().manual_seed(7)
    num_tokens = int(metadata.query_start_loc[-1])
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    out = PagedAttention(num_heads, num_kv_heads, head_dim)(q, k, v, kv_cache, metadata)
    for seq, (old_k, old_v) in enumerate(history):
        start, end = int(metadata.query_start_loc[seq]), int(metadata.query_start_loc[seq + 1])
        keys = torch.cat([old_k, k[start:end].to(dtype).float()])
        values = torch.cat([old_v, v[start:end].to(dtype).float()])
        expected = naive_attention(q[start:end], keys, values).reshape(end - start, -1)
        torch.testing.assert_close(out[start:end], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_fresh_prompt_reads_its_own_kv_exactly_as_the_pages_hold_it(dtype: torch.dtype) -> None:
    """The fresh-prompt path skips the page gather; its result equals attending over the gathered pages
    bit for bit (same values, same kernel), and the pages are written all the same."""
    num_heads, num_kv_heads, head_dim = 9, 3, 16
    metadata, kv_cache, _ = paged_batch([(0, 70)], num_kv_heads, head_dim, dtype)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(70, n, head_dim, generator=gen) for n in (num_heads, num_kv_heads, num_kv_heads))
    attention = PagedAttention(num_heads, num_kv_heads, head_dim)
    out = attention(q, k, v, kv_cache, metadata)
    keys, values = attention._gather_context(kv_cache[0], kv_cache[1], metadata, 0)
    assert torch.equal(keys, k.to(dtype)) and torch.equal(values, v.to(dtype))
    assert torch.equal(out, attention._attend(q, keys, values, num_context=70).reshape(70, -1))
