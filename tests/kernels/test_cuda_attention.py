"""The Triton paged-attention kernels (kernels/cuda/paged_attention.py) against the eager layers they
replace: RoPE bit for bit and the cache bytes equal (RotaryEmbedding, PagedAttention._write_kv), decode
and prefill attention within f32 tolerance of PagedAttention's eager path (fused=None).

Runs on a CUDA device, or in Triton's CPU interpreter (TRITON_INTERPRET=1, no CUDA device) on small
shapes; CI deselects it (gpu marker).
"""

from __future__ import annotations

import pytest
import torch

from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu
DEVICE = kernel_test_device()

from bitserve.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from bitserve.kernels.cuda.paged_attention import paged_decode_attention  # noqa: E402
from bitserve.kernels.cuda.paged_prefill import paged_prefill_attention  # noqa: E402
from bitserve.kernels.cuda.rotary_cache import rotary_and_cache_  # noqa: E402
from bitserve.layers.attention import PagedAttention  # noqa: E402
from bitserve.layers.rotary import RopeStyle, RotaryEmbedding  # noqa: E402

ON_GPU = DEVICE == "cuda"
HEAD_DIMS = (64, 128) if ON_GPU else (64,)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Attention: products on tensor cores at near-f32 accuracy (tf32x3, or the f32 operand split into f16 /
# bf16 terms), sums in the kernels' own order. Measured on an H100 against an f64 reference (decode, D 64
# and 128, contexts up to 2000): max error / max |out| 2.5e-6 (f32 pages), 1.5e-6 (f16), 0.8e-6 (bf16).
# The eager f32 path is off by as much again, so 1e-5 on O(1) outputs leaves a ~2x margin. RoPE and the
# cache bytes are exact (no FMA contraction in the kernel; round-to-nearest-even casts).
RTOL = ATOL = 1e-5


def _page_table(lens: list[int], block_size: int, width: int, num_blocks: int, gen: torch.Generator):
    """A block table whose rows hold disjoint shuffled pages, padded past each sequence's blocks with
    entries that would fault if read (-1, num_blocks + 7)."""
    table = torch.empty(len(lens), width, dtype=torch.int64)
    pages = torch.randperm(num_blocks, generator=gen)
    used = 0
    for row, length in enumerate(lens):
        count = -(-length // block_size)
        table[row, :count] = pages[used : used + count]
        table[row, count:] = -1 if row % 2 else num_blocks + 7
        used += count
    assert used <= num_blocks
    return table


def _slots(table: torch.Tensor, lens: list[int], counts: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of the last counts[s] positions of each sequence s (the step's tokens)."""
    slots = [
        int(table[row, p // block_size]) * block_size + p % block_size
        for row, (length, count) in enumerate(zip(lens, counts, strict=True))
        for p in range(length - count, length)
    ]
    return torch.tensor(slots, dtype=torch.int64)


def _eager(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    lens: list[int],
    counts: list[int],
    num_kv_heads: int,
    decode: bool,
) -> torch.Tensor:
    """PagedAttention's eager forward (fused=None) on CPU: its k / v are the step's own entries read
    back from the cache, so its cache write changes nothing -> f32 [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    block_size = kv_cache.shape[2]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    cache = kv_cache.cpu().clone()
    slots = _slots(table, lens, counts, block_size)
    keys, values = cache[0].flatten(0, 1)[slots].float(), cache[1].flatten(0, 1)[slots].float()
    safe_table = table.clamp(0, kv_cache.shape[1] - 1)  # the eager path slices rows to their blocks
    metadata = AttentionMetadata.from_host(slots, safe_table, lens, starts, block_size, batch_decodes=decode)
    out = PagedAttention(num_heads, num_kv_heads, head_dim)(q.cpu(), keys, values, cache, metadata)
    return out.view(num_tokens, num_heads, head_dim)


def _random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, gen):  # noqa: ANN001, ANN202
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return cache.to(dtype).to(DEVICE)


# ------------------------------------------------------------------ RoPE + cache write


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("style", [RopeStyle.NEOX, RopeStyle.NORM])
@pytest.mark.parametrize(("head_dim", "rope_dim"), [(64, 64), (64, 32), (128, 128), (128, 96)])
def test_rotary_and_cache_match_the_layer(
    dtype: torch.dtype, style: RopeStyle, head_dim: int, rope_dim: int
) -> None:
    """q / k views of one stacked [T, (H + 2 KVH) D] projection, rotated bit for bit; the cache holds
    exactly what PagedAttention._write_kv stores; a negative slot writes nothing."""
    num_tokens, num_heads, num_kv_heads, block_size, num_blocks = 7, 9, 3, 4, 6
    gen = torch.Generator().manual_seed(head_dim * 7 + rope_dim + len(style.value))
    stacked = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 4.0
    q, k, v = stacked.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q, k, v = (x.reshape(num_tokens, -1, head_dim) for x in (q, k, v))
    positions = torch.tensor([0, 1, 4095, 77, 3, 2048, 1000])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1
    rotary = RotaryEmbedding(rope_dim, 10000.0, 4096, style, freq_factors=torch.linspace(1, 2, rope_dim // 2))
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected_cache = cache.clone()
    written = slots >= 0
    PagedAttention._write_kv(expected_k[written], v[written], expected_cache, slots[written])

    stacked_dev = stacked.to(DEVICE)
    q_dev, k_dev, v_dev = (
        x.reshape(num_tokens, -1, head_dim)
        for x in stacked_dev.split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1
        )
    )
    assert not q_dev.is_contiguous()
    cache_dev = cache.to(DEVICE)
    rotary_and_cache_(
        q_dev, k_dev, v_dev, positions.to(DEVICE), rotary.cos.to(DEVICE), rotary.sin.to(DEVICE), rope_dim,
        style is RopeStyle.NEOX, cache_dev, slots.to(DEVICE),
    )  # fmt: skip
    assert torch.equal(q_dev.cpu(), expected_q)
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), v)  # v is read only
    assert torch.equal(cache_dev.cpu(), expected_cache)


# ------------------------------------------------------------------ decode


DECODE_LENS = [1, 16, 17, 100, 255, 300, 33]


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (20, 5), (4, 4)])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_decode_matches_the_eager_path(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int | None
) -> None:
    """Lengths 1..300 over several 16-token pages, shuffled and padded table rows (int32), GQA groups
    3 / 4 / 1; one kernel (splits 1), flash-decoding (4) and the size-derived choice (None)."""
    block_size, width = 16, 24
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim + (num_splits or 0))
    num_blocks = sum(-(-n // block_size) for n in DECODE_LENS) + 5
    cache = _random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    table = _page_table(DECODE_LENS, block_size, width, num_blocks, gen)
    q = torch.randn(len(DECODE_LENS), num_heads, head_dim, generator=gen)
    expected = _eager(q, cache, table, DECODE_LENS, [1] * len(DECODE_LENS), num_kv_heads, decode=True)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    table_dev = table.to(torch.int32).to(DEVICE)
    out = paged_decode_attention(q.to(DEVICE), cache, table_dev, lens, scale, num_splits=num_splits)
    torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_decode_block_sizes_and_out(block_size: int) -> None:
    """Other page sizes, int64 tables, an `out` view of a wider buffer, and a zero row for seq_len 0."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    lens = [300, 1, 129, 64]
    gen = torch.Generator().manual_seed(block_size)
    width = -(-300 // block_size) + 1
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = _random_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float16, gen)
    table = _page_table(lens, block_size, width, num_blocks, gen)
    q = torch.randn(len(lens) + 1, num_heads, head_dim, generator=gen)
    expected = _eager(q[:-1], cache, table, lens, [1] * len(lens), num_kv_heads, decode=True)
    buffer = torch.full((len(lens) + 1, num_heads, 2 * head_dim), float("nan"), device=DEVICE)
    out = buffer[:, :, :head_dim]
    table = torch.cat([table, torch.full((1, width), -1, dtype=torch.int64)]).to(DEVICE)
    seq_lens = torch.tensor([*lens, 0], device=DEVICE)
    result = paged_decode_attention(
        q.to(DEVICE), cache, table, seq_lens, head_dim**-0.5, out=out, num_splits=3
    )
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out[:-1].cpu(), expected, rtol=RTOL, atol=ATOL)
    assert torch.equal(out[-1].cpu(), torch.zeros(num_heads, head_dim))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
def test_decode_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed after seq_lens and the table change on the device: no host sync inside,
    and the grid does not depend on the lengths."""
    num_heads, num_kv_heads, head_dim, block_size, width = 20, 5, 128, 16, 32
    gen = torch.Generator().manual_seed(5)
    cache = _random_cache(256, block_size, num_kv_heads, head_dim, torch.float16, gen)
    q = torch.randn(4, num_heads, head_dim, generator=gen).to(DEVICE)
    table = torch.zeros(4, width, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.ones(4, dtype=torch.int64, device=DEVICE)
    out = torch.empty(4, num_heads, head_dim, device=DEVICE)
    paged_decode_attention(q, cache, table, seq_lens, head_dim**-0.5, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, cache, table, seq_lens, head_dim**-0.5, out=out)
    for lens in ([1, 500, 17, 300], [511, 2, 64, 129]):
        host_table = _page_table(lens, block_size, width, 256, gen)
        table.copy_(host_table)
        seq_lens.copy_(torch.tensor(lens))
        graph.replay()
        expected = _eager(q.cpu(), cache, host_table, lens, [1] * 4, num_kv_heads, decode=True)
        torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ prefill


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_matches_the_eager_path(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """One varlen batch: decodes (n = 1), whole prompts, and chunks over a cached prefix (the pages
    holding earlier tokens), GQA groups 3 / 4 / 1, shuffled and padded int64 table rows."""
    block_size, width = 16, 24
    lens = [1, 300, 70, 5, 129, 40]
    counts = [1, 37, 70, 1, 64, 40]  # queries this step: the last `count` positions of each sequence
    gen = torch.Generator().manual_seed(num_heads * 10 + head_dim)
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    cache = _random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    table = _page_table(lens, block_size, width, num_blocks, gen)
    q = torch.randn(sum(counts), num_heads, head_dim, generator=gen)
    expected = _eager(q, cache, table, lens, counts, num_kv_heads, decode=False)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(
        q.to(DEVICE), cache, table.to(DEVICE), torch.tensor(lens, device=DEVICE), starts, head_dim**-0.5,
        max_query_len=max(counts),
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("block_size", [8, 128])
def test_prefill_after_rotary_and_cache(block_size: int) -> None:
    """The integrated step: rotary_and_cache_ writes the chunk's keys (bf16 cache) next to a cached
    prefix, then prefill attends over the pages; the eager layers do the same from the same inputs."""
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    lens, counts = [50, 3, 20], [20, 3, 1]
    gen = torch.Generator().manual_seed(block_size + 1)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    table = _page_table(lens, block_size, 8, num_blocks, gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    num_tokens = sum(counts)
    q, k, v = (
        torch.randn(num_tokens, h, head_dim, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    positions = torch.tensor([p for n, c in zip(lens, counts, strict=True) for p in range(n - c, n)])
    slots = _slots(table, lens, counts, block_size)
    rotary = RotaryEmbedding(head_dim, 10000.0, 64, RopeStyle.NEOX)
    q_rot, k_rot = rotary(positions, q.clone(), k.clone())
    expected_cache = cache.clone()
    PagedAttention._write_kv(k_rot, v, expected_cache, slots)
    expected = _eager(q_rot, expected_cache, table, lens, counts, num_kv_heads, decode=False)

    cache_dev, q_dev, k_dev = cache.to(DEVICE), q.to(DEVICE), k.to(DEVICE)
    rotary_and_cache_(
        q_dev, k_dev, v.to(DEVICE), positions.to(DEVICE), rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
        head_dim, True, cache_dev, slots.to(DEVICE),
    )  # fmt: skip
    assert torch.equal(cache_dev.cpu(), expected_cache)
    starts = torch.tensor([0, 20, 23, 24], device=DEVICE)
    out = paged_prefill_attention(
        q_dev, cache_dev, table.to(DEVICE), torch.tensor(lens, device=DEVICE), starts, head_dim**-0.5, 20
    )
    torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)
