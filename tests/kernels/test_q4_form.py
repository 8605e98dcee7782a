"""kernels/cuda/block_layout.repack_as_q4 (torch only, runs anywhere): llama.cpp's Q2_0 / Q1_0 and Q4_K
weights held in the CUDA block GEMV's Q4 form (nibble codes, d and m per 32 values) rebuild the reference
decoders' values bit for bit (every product is exact in f32), so the GEMV runs them as it runs Q4_1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitserve.kernels.cuda.block_layout import Q4_FORM_LAYOUTS, repack_as_q4
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import dequantize
from bitserve.loader.low_bit_quantize import QUANTIZERS
from bitserve.testing.mixed_formats import random_k_quant


def _file_rows(layout: Layout, num_rows: int, num_cols: int) -> np.ndarray:
    rng = np.random.default_rng(num_rows)
    if layout is Layout.Q4_K:
        return random_k_quant(num_rows, num_cols, "Q4_K", seed=num_rows)
    values = (rng.standard_normal((num_rows, num_cols)) * 0.05).astype(np.float32)
    values[1, :64] = np.linspace(-1.0, 2.0, 64, dtype=np.float32)  # Q2_0's code 3 (+2 d)
    values[2, :128] = 0.0  # d = 0 blocks
    return QUANTIZERS[layout.name](values).reshape(num_rows, -1)


@pytest.mark.parametrize("layout", Q4_FORM_LAYOUTS, ids=lambda layout: layout.name)
def test_q4_form_rebuilds_the_reference_values_bit_for_bit(layout: Layout) -> None:
    num_rows, num_cols = 6, 512
    rows = torch.from_numpy(_file_rows(layout, num_rows, num_cols))
    parts = repack_as_q4(rows, layout, num_cols)
    assert parts["codes"].shape == (num_rows, num_cols // 2) and parts["codes"].dtype == torch.uint8
    assert parts["d"].shape == parts["m"].shape == (num_rows, num_cols // 32)
    low, high = parts["codes"] & 15, parts["codes"] >> 4  # [M, K / 2]: 16 bytes per 32 values
    codes = torch.cat([low.reshape(num_rows, -1, 16), high.reshape(num_rows, -1, 16)], dim=2)
    rebuilt = codes.reshape(num_rows, num_cols).float() * parts["d"].repeat_interleave(32, dim=1)
    rebuilt = rebuilt + parts["m"].repeat_interleave(32, dim=1)
    weight = PackedWeight(rows.reshape(-1), (num_rows, num_cols), layout, layout.name)
    expected = dequantize(weight)
    assert torch.equal(rebuilt.view(torch.int32), expected.view(torch.int32)) or torch.equal(
        rebuilt, expected
    )
