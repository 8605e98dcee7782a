"""kernels/cuda/block_layout.repack_for_gemv (torch only, runs anywhere): every block layout the CUDA block
GEMV takes (Q4_* / Q5_* / Q8_0, llama.cpp's Q2_0 / Q1_0, the K-quants) held in its form (nibble or int8
codes, d and m per 32 or per 16 values) rebuilds the reference decoder's values bit for bit (every product
is exact in f32), in the storage its form declares."""

from __future__ import annotations

import pytest
import torch

from bitserve.kernels.cuda.block_layout import FORMS, HELD_AS, form_values, repack_for_gemv
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import dequantize
from bitserve.testing.block_files import block_file_rows


@pytest.mark.parametrize("layout", list(HELD_AS), ids=lambda layout: layout.name)
def test_each_form_rebuilds_the_reference_values_bit_for_bit(layout: Layout) -> None:
    num_rows, num_cols = 6, 512
    rows = torch.from_numpy(block_file_rows(layout, num_rows, num_cols, seed=num_rows))
    form_name, parts = repack_for_gemv(rows, layout, num_cols)
    form = FORMS[form_name]
    codes = parts["codes"]
    if form.nibbles:
        assert codes.shape == (num_rows, num_cols // 2) and codes.dtype == torch.uint8
    else:
        assert codes.shape == (num_rows, num_cols) and codes.dtype == torch.int8
    assert parts["d"].shape == (num_rows, num_cols // form.values_per_scale)
    assert ("m" in parts) == form.has_min
    weight = PackedWeight(rows.reshape(-1), (num_rows, num_cols), layout, layout.name)
    expected = dequantize(weight)
    rebuilt = form_values(parts, num_cols)
    assert torch.equal(rebuilt, expected), (rebuilt - expected).abs().max()


def test_the_device_footprint_counts_each_forms_bytes() -> None:
    """`--device auto`'s estimate (loader/cuda_footprint.py, which may not import torch) repeats each
    form's bytes a weight: they must be what repack_for_gemv holds (0.75 to 1.25, against f32's 4)."""
    from bitserve.loader.cuda_footprint import BLOCK_PACKED_BYTES
    from bitserve.loader.gguf_types import GGMLType

    assert {layout.name for layout in HELD_AS} == {ggml_type.name for ggml_type in BLOCK_PACKED_BYTES}
    for layout in HELD_AS:
        _, parts = repack_for_gemv(torch.from_numpy(block_file_rows(layout, 4, 256, seed=1)), layout, 256)
        size = sum(t.numel() * t.element_size() for t in parts.values()) / (4 * 256)
        assert size == BLOCK_PACKED_BYTES[GGMLType[layout.name]], layout
