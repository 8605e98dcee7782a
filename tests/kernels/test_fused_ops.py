"""The cpu backend's fused small ops against the eager torch layers they replace: RMSNorm and RoPE
bit for bit, paged decode attention within fp32 tolerance, over odd shapes, GQA and ragged batches."""

from __future__ import annotations

import pytest
import torch

from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.kernels.cpu.backend import CpuBackend
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.layers.attention import PagedAttention
from bitserve.layers.norm import RMSNorm
from bitserve.layers.rotary import RopeStyle, RotaryEmbedding

BACKEND = CpuBackend()


def test_only_backends_with_the_kernels_offer_them() -> None:
    assert BACKEND.fused_ops() is BACKEND and ReferenceBackend().fused_ops() is None


@pytest.mark.parametrize("shape", [(1, 576), (3, 1536), (17, 2560), (2, 7)])
def test_rms_norm_is_bit_identical(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    x = torch.randn(shape, generator=gen) * 3.0
    weight = torch.randn(shape[1], generator=gen)
    expected = RMSNorm(weight, 1e-6)(x)
    assert torch.equal(RMSNorm(weight, 1e-6, BACKEND)(x), expected)


@pytest.mark.parametrize("style", [RopeStyle.NEOX, RopeStyle.NORM])
@pytest.mark.parametrize(("head_dim", "rope_dim"), [(64, 64), (128, 64), (6, 4)])
def test_rotary_is_bit_identical(style: RopeStyle, head_dim: int, rope_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + rope_dim)
    positions = torch.tensor([0, 5, 4095, 77, 3])
    q = torch.randn(5, 9, head_dim, generator=gen)
    k = torch.randn(5, 3, head_dim, generator=gen)
    eager = RotaryEmbedding(rope_dim, 10000.0, 4096, style, freq_factors=torch.linspace(1, 2, rope_dim // 2))
    fused = RotaryEmbedding(
        rope_dim, 10000.0, 4096, style, freq_factors=torch.linspace(1, 2, rope_dim // 2), fused=BACKEND
    )
    expected_q, expected_k = eager(positions, q.clone(), k.clone())
    actual_q, actual_k = fused(positions, q.clone(), k.clone())
    assert torch.equal(actual_q, expected_q) and torch.equal(actual_k, expected_k)


@pytest.mark.parametrize("window", [0, 5])  # 5: a sliding layer's (Gemma), shorter than most sequences
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
def test_paged_decode_attention_matches_the_eager_path(
    num_heads: int, num_kv_heads: int, window: int
) -> None:
    head_dim, block_size, num_blocks = 16, 4, 32
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    seq_lens = [1, 9, 4, 13]  # ragged, block-boundary cases included
    block_table = torch.zeros(len(seq_lens), 4, dtype=torch.int64)
    shuffled = torch.randperm(num_blocks, generator=gen)  # pages scattered over the pool
    for row, length in enumerate(seq_lens):
        num_used = -(-length // block_size)
        block_table[row, :num_used] = shuffled[row * 4 : row * 4 + num_used]
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    k_new = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=gen)
    v_new = torch.randn(len(seq_lens), num_kv_heads, head_dim, generator=gen)
    slots = [
        int(block_table[row, (n - 1) // block_size]) * block_size + (n - 1) % block_size
        for row, n in enumerate(seq_lens)
    ]
    query_start_loc = list(range(len(seq_lens) + 1))
    metadata = AttentionMetadata.from_host(
        torch.tensor(slots), block_table, seq_lens, query_start_loc, block_size
    )
    assert metadata.host is not None and metadata.host.other_seq_ids == ()  # all four batched as decodes
    eager = PagedAttention(num_heads, num_kv_heads, head_dim, sliding_window=window)(
        q, k_new, v_new, kv_cache.clone(), metadata
    )
    fused = PagedAttention(num_heads, num_kv_heads, head_dim, BACKEND, sliding_window=window)(
        q, k_new, v_new, kv_cache.clone(), metadata
    )
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


def test_rotary_takes_column_slices_of_a_stacked_projection() -> None:
    """q / k as views into one [T, q + k + v] output (a stacked group): same values as contiguous inputs."""
    gen = torch.Generator().manual_seed(3)
    stacked = torch.randn(4, (9 + 3 + 3) * 64, generator=gen)
    q = stacked[:, : 9 * 64].reshape(4, 9, 64)
    k = stacked[:, 9 * 64 : 12 * 64].reshape(4, 3, 64)
    assert not q.is_contiguous()
    positions = torch.tensor([1, 2, 3, 4])
    eager = RotaryEmbedding(64, 10000.0, 64, RopeStyle.NORM)
    fused = RotaryEmbedding(64, 10000.0, 64, RopeStyle.NORM, fused=BACKEND)
    expected = eager(positions, q.clone(), k.clone())
    actual = fused(positions, q, k)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
