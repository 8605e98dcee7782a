"""2-bit plane packing of the CUDA kernels (bitserve/kernels/cuda/ternary_pack.py): pure torch, runs in CI."""

from __future__ import annotations

import pytest
import torch

from bitserve.kernels.cuda.ternary_pack import GROUP, pack_ternary_planes, unpack_ternary_planes


def _values(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, (m, k), dtype=torch.int8, generator=gen)


@pytest.mark.parametrize(("m", "k"), [(1, 128), (3, 256), (17, 768), (64, 2560)])
def test_round_trip(m: int, k: int) -> None:
    values = _values(m, k, m * k)
    packed = pack_ternary_planes(values)
    assert packed.dtype == torch.uint8 and packed.shape == (m, k // 4)
    assert torch.equal(unpack_ternary_planes(packed, k), values)


def test_layout_bytes_hold_four_planes_of_contiguous_columns() -> None:
    """Byte i of group g holds column g*128 + i + 32j at bits 2j..2j+1 as the code w + 1 (a scalar loop)."""
    m, k = 5, 384
    values = _values(m, k, 7)
    packed = pack_ternary_planes(values)
    for row in range(m):
        for g in range(k // GROUP):
            for i in range(32):
                byte = int(packed[row, g * 32 + i])
                for j in range(4):
                    assert (byte >> (2 * j)) & 3 == int(values[row, g * GROUP + i + 32 * j]) + 1


def test_all_zero_weights_pack_to_code_one() -> None:
    packed = pack_ternary_planes(torch.zeros(2, 128, dtype=torch.int8))
    assert bool((packed == 0b01010101).all())


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        pack_ternary_planes(torch.zeros(2, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        pack_ternary_planes(torch.zeros(2, 128, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"\{-1, 0, 1\}"):
        pack_ternary_planes(torch.full((1, 128), 2, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\{-1, 0, 1\}"):
        pack_ternary_planes(torch.full((1, 128), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match="do not hold"):
        unpack_ternary_planes(torch.zeros(2, 32, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="unused code 3"):
        unpack_ternary_planes(torch.full((1, 32), 0xFF, dtype=torch.uint8), 128)
