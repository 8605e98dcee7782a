"""The CUDA path's Gemma 3 pieces, kernel by kernel: sliding-window decode and prefill attention
(kernels/cuda/paged_attention.py, paged_prefill.py: `window`) against a float64 torch reference over
random paged caches, the embedding scale of the decode graphs' first kernel (decode_inputs.py), the
post-norm's fused residual add (elementwise.rms_norm) and the logit soft-cap (CudaDecoder).

Runs on a CUDA device, or on the CPU in Triton's interpreter (`TRITON_INTERPRET=1`, small shapes).
"""

from __future__ import annotations

import pytest
import torch

from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu
DEVICE = kernel_test_device()

from bitserve.kernels.cuda.decode_inputs import prepare_decode_step  # noqa: E402
from bitserve.kernels.cuda.elementwise import rms_norm  # noqa: E402
from bitserve.kernels.cuda.paged_attention import paged_decode_attention  # noqa: E402
from bitserve.kernels.cuda.paged_prefill import paged_prefill_attention  # noqa: E402

ON_GPU = DEVICE == "cuda"
HEAD_DIMS = (64, 256) if ON_GPU else (64,)  # 256: Gemma 3's heads (f32 prefill: 16-key tiles)
# as tests/kernels/test_cuda_attention.py: the kernels' products at near-f32 accuracy, summed in their
# own order (measured against f64: max error / max |out| <= 2.5e-6)
RTOL = ATOL = 1e-5
BLOCK_SIZE = 16
# windows: one key (each query sees itself only), Gemma-test-sized, not a tile multiple, a tile, and
# one at least as long as every context (the whole causal context)
WINDOWS = (1, 5, 37, 64, 4096)


def _page_table(lens: list[int], width: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [seqs, width]: each row disjoint shuffled pages, padded with -1 (a fault if read)."""
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    pages = torch.randperm(num_blocks, generator=gen)
    used = 0
    for row, length in enumerate(lens):
        count = -(-length // BLOCK_SIZE)
        table[row, :count] = pages[used : used + count].to(torch.int32)
        used += count
    assert used <= num_blocks
    return table


def _context(cache: torch.Tensor, table: torch.Tensor, row: int, length: int) -> tuple[torch.Tensor, ...]:
    """Sequence `row`'s keys and values, f64 [length, KVH, D] each."""
    blocks = table[row, : -(-length // BLOCK_SIZE)].long()
    keys = cache[0].cpu()[blocks].flatten(0, 1)[:length].double()
    return keys, cache[1].cpu()[blocks].flatten(0, 1)[:length].double()


def reference_attention(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: list[int], counts: list[int],
    scale: float, window: int,
) -> torch.Tensor:  # fmt: skip
    """f64 softmax attention: sequence s's counts[s] queries (q rows in order) sit at its last positions;
    query p sees keys p' <= p with p - p' < window (window 0: every p' <= p) -> f32 [T, H, D]."""
    num_heads, num_kv_heads = q.shape[1], cache.shape[3]
    out, row = [], 0
    for seq, (length, count) in enumerate(zip(lens, counts, strict=True)):
        keys, values = _context(cache, table, seq, length)
        group = num_heads // num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [L, H, D]
        positions = torch.arange(length - count, length)[:, None]  # [n, 1]
        key_ids = torch.arange(length)[None, :]  # [1, L]
        visible = key_ids <= positions
        if window:
            visible &= positions - key_ids < window
        queries = q[row : row + count].cpu().double()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->nhl", queries, keys) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out.append(torch.einsum("nhl,lhd->nhd", torch.softmax(scores, dim=-1), values))
        row += count
    return torch.cat(out).float()


def _random_cache(num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gen) -> torch.Tensor:  # noqa: ANN001
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    return cache.to(dtype)


def _poison_before(
    cache: torch.Tensor, table: torch.Tensor, lens: list[int], firsts: list[int]
) -> torch.Tensor:
    """A copy of the cache with NaN keys and values at positions < firsts[s] of each sequence s: slots a
    windowed kernel must never read (a NaN value times a zero weight would still poison the output)."""
    poisoned = cache.clone()
    for seq, (length, first) in enumerate(zip(lens, firsts, strict=True)):
        for position in range(min(first, length)):
            block = int(table[seq, position // BLOCK_SIZE])
            poisoned[:, block, position % BLOCK_SIZE] = float("nan")
    return poisoned


DECODE_LENS = [1, 5, 16, 17, 100, 300, 33]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 4, None])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_windowed_decode_matches_reference(
    dtype: torch.dtype, window: int, num_splits: int | None, head_dim: int
) -> None:
    """One query per sequence (lengths 1..300, shorter and longer than the window), GQA group 4, the
    splits dividing only the window's keys: equal to the f64 reference, and the keys before each window
    are never read (NaN there changes nothing)."""
    num_heads, num_kv_heads = 8, 2
    gen = torch.Generator().manual_seed(window * 10 + head_dim + (num_splits or 0))
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in DECODE_LENS) + 3
    cache = _random_cache(num_blocks, num_kv_heads, head_dim, dtype, gen)
    table = _page_table(DECODE_LENS, 24, num_blocks, gen)
    q = torch.randn(len(DECODE_LENS), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = reference_attention(q, cache, table, DECODE_LENS, [1] * len(DECODE_LENS), scale, window)
    poisoned = _poison_before(cache, table, DECODE_LENS, [n - window for n in DECODE_LENS])
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        q.to(DEVICE), poisoned.to(DEVICE), table.to(DEVICE), lens, scale, num_splits=num_splits, window=window
    )
    torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)


def test_window_zero_is_the_whole_context() -> None:
    """window=0 (the default) attends over every key, in both kernels."""
    gen = torch.Generator().manual_seed(3)
    lens, counts = [70, 9], [70, 1]
    cache = _random_cache(8, 2, 64, torch.float16, gen)
    table = _page_table(lens, 6, 8, gen)
    q = torch.randn(sum(counts), 4, 64, generator=gen)
    expected = reference_attention(q, cache, table, lens, counts, 0.125, 0)
    starts = torch.tensor([0, 70, 71], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cache_dev, table_dev = cache.to(DEVICE), table.to(DEVICE)
    out = paged_prefill_attention(q.to(DEVICE), cache_dev, table_dev, seq_lens, starts, 0.125, 70, window=0)
    torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)
    decode = paged_decode_attention(q[-1:].to(DEVICE), cache_dev, table_dev[1:], seq_lens[1:], 0.125)
    torch.testing.assert_close(decode.cpu(), expected[-1:], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_windowed_prefill_matches_reference(
    dtype: torch.dtype, window: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """One varlen batch: decodes (n = 1), whole prompts longer than the window, and chunks over a cached
    prefix, GQA groups 4 / 1: equal to the f64 reference; key tiles before a query tile's first band
    are not read (NaN in the 64 keys-aligned blocks before every query's band changes nothing)."""
    lens = [1, 300, 70, 5, 129, 40]
    counts = [1, 37, 70, 1, 64, 40]
    gen = torch.Generator().manual_seed(window + num_heads * 7 + head_dim)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 2
    cache = _random_cache(num_blocks, num_kv_heads, head_dim, dtype, gen)
    table = _page_table(lens, 24, num_blocks, gen)
    q = torch.randn(sum(counts), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    expected = reference_attention(q, cache, table, lens, counts, scale, window)
    # the first query of a sequence sits at length - count; its band starts window - 1 before it
    firsts = [max(0, n - c - window + 1) // 64 * 64 for n, c in zip(lens, counts, strict=True)]
    poisoned = _poison_before(cache, table, lens, firsts)
    starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(
        q.to(DEVICE), poisoned.to(DEVICE), table.to(DEVICE), torch.tensor(lens, device=DEVICE), starts,
        scale, max(counts), window=window,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)


def test_negative_windows_are_refused() -> None:
    q = torch.zeros(1, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 1, BLOCK_SIZE, 2, 64, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, cache, table, lens, 1.0, window=-1)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="window"):
        paged_prefill_attention(q, cache, table, lens, starts, 1.0, 1, window=-1)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float16])
def test_decode_inputs_scale_the_embedding(table_dtype: torch.dtype) -> None:
    """The decode graphs' first kernel: each row's embedding widened to f32, then times the scale (as
    CudaDecoder.forward and the module forward: f32 row * f32(scale)), bit for bit."""
    gen = torch.Generator().manual_seed(1)
    embedding = torch.randn(50, 96, generator=gen).to(table_dtype)
    ids, positions = [3, 49, 0], [0, 17, 5]
    inputs = torch.zeros(4, 3, dtype=torch.int64)
    inputs[0], inputs[1] = torch.tensor(ids), torch.tensor(positions)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)
    scale = 96**0.5
    hidden = prepare_decode_step(inputs.to(DEVICE), table.to(DEVICE), embedding.to(DEVICE), BLOCK_SIZE, scale)
    assert torch.equal(hidden.cpu(), embedding[ids].float() * scale)
    plain = prepare_decode_step(inputs.to(DEVICE), table.to(DEVICE), embedding.to(DEVICE), BLOCK_SIZE)
    assert torch.equal(plain.cpu(), embedding[ids].float())


def test_rms_norm_adds_the_residual() -> None:
    """A post-norm's launch: residual + rms_norm(x), the norm the plain launch computes, then the add."""
    gen = torch.Generator().manual_seed(2)
    x, residual = torch.randn(5, 200, generator=gen) * 3.0, torch.randn(5, 200, generator=gen)
    weight = torch.rand(200, generator=gen) + 0.5
    x_dev, w_dev, r_dev = x.to(DEVICE), weight.to(DEVICE), residual.to(DEVICE)
    normed = rms_norm(x_dev, w_dev, 1e-6)
    fused = rms_norm(x_dev, w_dev, 1e-6, residual=r_dev)
    # the same f32 operations, possibly one FMA (the product and the add): within an ulp
    torch.testing.assert_close(fused.cpu(), residual + normed.cpu(), rtol=2e-7, atol=1e-6)
    expected = x * torch.rsqrt(x.double().square().mean(1, keepdim=True) + 1e-6).float() * weight + residual
    torch.testing.assert_close(fused.cpu(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x_dev, w_dev, 1e-6, torch.float16, residual=r_dev)
