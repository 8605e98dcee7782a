"""The converter's ternary writers from codes (loader/ternary_pack.py): TQ2_0 bytes equal gguf-py's
quantizer (llama.cpp's quantize_row_tq2_0_ref) for codes x scale, zero blocks included; I2_S bytes equal
quantize_i2s's for the same values, in every variant."""

from __future__ import annotations

import numpy as np
import pytest

from bitserve.loader.ternary_pack import i2s_from_codes, quantize_i2s, tq2_0_from_codes


def _codes(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    codes = np.random.default_rng(seed).integers(-1, 2, size=(rows, cols)).astype(np.int8)
    codes[1, :256] = 0  # a block of zeros: ggml writes d = 0 for it
    return codes


def test_tq2_0_equals_gguf_py() -> None:
    gguf = pytest.importorskip("gguf")
    codes = _codes(4, 512)
    for scale in (0.0123, 3.0, 1.0 / 3.0):
        expected = gguf.quants.quantize(
            codes.astype(np.float32) * np.float32(scale), gguf.GGMLQuantizationType.TQ2_0
        )
        assert tq2_0_from_codes(codes, scale) == expected.tobytes(), scale


@pytest.mark.parametrize("variant", ["A", "B", "C"])
def test_i2s_from_codes_equals_quantize_i2s(variant: str) -> None:
    codes = _codes(8, 256, seed=1)
    scale = 0.0371
    assert i2s_from_codes(codes, scale, variant) == quantize_i2s(
        codes.astype(np.float32) * np.float32(scale), variant
    )
